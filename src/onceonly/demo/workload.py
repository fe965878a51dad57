"""What the demo's agents ask for, drawn from one seed. Pure, no I/O.

An *operation* is one ticket an agent means to create: a session and a title (the business key). An
*ask* is one call of the agent's tool for it. Most operations are asked once; three patterns ask again:

- re-planning: the same agent asks for the same ticket a few steps later, the body re-worded (an LLM
  that lost track of what it did, or re-planned after an error);
- shared: a second agent of the same session asks for the same ticket at about the same time;
- rewording: the same agent asks for the same ticket a few steps later in other words, the title too
  ("Printer on fire #12" comes back as "The printer is on fire! #12"): a model that re-plans after an
  error it did not understand does not repeat itself word for word. Only the words change: the
  ticket's number stays, so a rewording never names another ticket.

Every ask's body ends with its operation's tag (``[op 12]``), which the service stores with the
ticket: the demo counts a ticket to its operation by the tag (``op_of``), whatever its title says.

The same seed gives the same asks, in the same order per agent, to every strategy. Each decision is
a named draw (``uniform(seed, what, op)``), not the next number of one generator: adding a kind of
decision leaves the others as they were.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from onceonly.tickets.faults import uniform

__all__ = ["Ask", "Workload", "make_workload", "op_of", "reword"]

_TOPICS = (
    "Printer on fire", "VPN drops every hour", "Refund order", "Reset password", "Laptop will not boot",
    "Invoice has the wrong address", "Disk almost full", "Access to the finance share", "Broken monitor",
    "Phone lost", "Badge does not open door", "Slow Wi-Fi on floor", "Update the payroll bank account",
)  # fmt: skip
#: What a model writes instead of each topic when it asks again in its own words: articles and "is" added
#: or dropped, a word added, the word order turned, one word made plural. Each scores at least 0.85
#: against its topic with the default score of ``onceonly.Similar`` (tests/demo/test_demo.py checks it).
_REWORDINGS: dict[str, tuple[str, ...]] = {
    "Printer on fire": ("The printer is on fire", "Printer is on fire", "Printers on fire"),
    "VPN drops every hour": ("The VPN drops every hour", "VPN connection drops every hour", "Every hour the VPN drops"),
    "Refund order": ("Refund the order", "Order refund", "Refund this order"),
    "Reset password": ("Reset my password", "Password reset", "Reset the password"),
    "Laptop will not boot": ("The laptop will not boot", "My laptop will not boot up", "Laptop will not boot anymore"),
    "Invoice has the wrong address": (
        "The invoice has the wrong address", "Invoice has wrong address", "Invoice has the wrong address on it",
    ),
    "Disk almost full": ("The disk is almost full", "Disk is almost full", "Disks almost full"),
    "Access to the finance share": (
        "Access to finance share", "Access to the finance shares", "Need access to the finance share",
    ),
    "Broken monitor": ("The monitor is broken", "Monitor broken", "Broken monitors"),
    "Phone lost": ("Lost phone", "The phone is lost", "Phone was lost"),
    "Badge does not open door": (
        "Badge does not open the door", "The badge does not open the door", "Badge does not open doors",
    ),
    "Slow Wi-Fi on floor": ("Slow Wi-Fi on the floor", "The Wi-Fi is slow on floor", "Wi-Fi slow on floor"),
    "Update the payroll bank account": (
        "Update payroll bank account", "Update the payroll bank accounts", "Please update the payroll bank account",
    ),
}  # fmt: skip
#: Where the ticket's number goes, and how the sentence ends: the number itself never changes.
_NUMBERED = ("{text} #{n}", "#{n}: {text}", "{text} (#{n})")
_ENDINGS = ("", "!", ".")
_TAG = re.compile(r"\[op (\d+)\]$")


@dataclass(frozen=True, slots=True)
class Ask:
    """One call of an agent's tool: create the ticket ``(session_id, title)`` with ``body``.

    Attributes:
        op: the operation's index (asks of the same operation share it).
        kind: ``"first"``, ``"replan"`` (the same agent again, body re-worded), ``"shared"`` (another
            agent of the session) or ``"reword"`` (the same agent again, title and body in other words).
        agent: the agent that asks (a shared ask is the partner's).
    """

    op: int
    session_id: str
    title: str
    body: str
    kind: str
    agent: int = 0

    @property
    def call_id(self) -> str:
        """This call's own name, the same in every run of its seed (a key-only call's key)."""
        return f"{self.op}-{self.kind}"


@dataclass(frozen=True, slots=True)
class Workload:
    """Every agent's asks, in order."""

    agents: tuple[tuple[Ask, ...], ...]
    operations: int

    @property
    def asks(self) -> int:
        return sum(len(a) for a in self.agents)

    def titles(self) -> list[list[tuple[str, str]]]:
        """The business keys each operation was asked with, by its index: the first ask's, then the
        reworded asks' (a reworded title is another business key for the same ticket)."""
        found: list[list[tuple[str, str]]] = [[] for _ in range(self.operations)]
        for ask in sorted((a for agent in self.agents for a in agent), key=lambda a: a.kind != "first"):
            key = (ask.session_id, ask.title)
            if key not in found[ask.op]:
                found[ask.op].append(key)
        return found

    def keys(self) -> list[tuple[str, str]]:
        """The business key of each operation, by its index: its first ask's."""
        return [keys[0] for keys in self.titles()]

    def reworded(self) -> set[int]:
        """The operations asked for again in other words."""
        return {ask.op for agent in self.agents for ask in agent if ask.kind == "reword"}


def reword(seed: int, op: int, topic: str) -> str:
    """Ticket ``op``'s title in other words, drawn from ``seed``: one of the topic's rewordings, its
    number placed elsewhere, lower case or not, a full stop or an exclamation mark."""

    def pick(options: tuple[str, ...], what: str) -> str:
        return options[int(uniform(seed, what, op) * len(options))]

    text = pick(_REWORDINGS[topic], "reword-words")
    if uniform(seed, "reword-case", op) < 0.3:
        text = text.lower()
    return pick(_NUMBERED, "reword-number").format(text=text, n=op) + pick(_ENDINGS, "reword-end")


def op_of(body: str) -> int | None:
    """The operation a ticket's body was asked for (its ``[op N]`` tag); ``None`` for a body without one."""
    m = _TAG.search(body)
    return None if m is None else int(m[1])


def make_workload(
    *,
    seed: int,
    agents: int,
    operations: int,
    replan_rate: float = 0.1,
    shared_rate: float = 0.1,
    reword_rate: float = 0.1,
) -> Workload:
    """Draw the asks of ``agents`` agents for ``operations`` tickets from ``seed``.

    Agents ``2k`` and ``2k+1`` work in one session (a planner and a worker), so that a shared
    ticket is asked by two agents of the same session. A reworded ask comes from the agent that asked
    first, after its first ask has ended: which of the two words the service sees first is then the
    same in every run.
    """
    if agents < 1 or operations < 1:
        raise ValueError(f"agents={agents}, operations={operations}: at least one of each")
    if not all(0 <= rate <= 1 for rate in (replan_rate, shared_rate, reword_rate)):
        raise ValueError("replan_rate, shared_rate and reword_rate are probabilities between 0 and 1")
    lists: list[list[Ask]] = [[] for _ in range(agents)]
    later: list[list[tuple[int, Ask]]] = [[] for _ in range(agents)]  # (position, ask) to insert
    for op in range(operations):
        agent = op % agents
        session = f"s{seed}-{agent // 2}"
        topic = _TOPICS[int(uniform(seed, "topic", op) * len(_TOPICS))]
        title = f"{topic} #{op}"
        said = f"Reported by agent {agent}: {title.lower()}, please look into it."
        body = f"{said} [op {op}]"
        first = Ask(op, session, title, body, "first", agent)
        lists[agent].append(first)
        position = len(lists[agent])
        if uniform(seed, "replan", op) < replan_rate:
            replanned = Ask(
                op, session, title, f"{said} (Re-planned: the user asked again.) [op {op}]", "replan", agent
            )
            later[agent].append((position + 1 + int(uniform(seed, "replan-after", op) * 4), replanned))
        if uniform(seed, "reword", op) < reword_rate:
            words = reword(seed, op, topic)
            again = f"Asked again by agent {agent}, in other words: {words} [op {op}]"
            later[agent].append(
                (
                    position + 1 + int(uniform(seed, "reword-after", op) * 4),
                    Ask(op, session, words, again, "reword", agent),
                )
            )
        partner = agent ^ 1
        if partner < agents and uniform(seed, "shared", op) < shared_rate:
            # The same body: onceonly sends a ticket's requests one at a time, whichever agent's call
            # sends them, and each must be the same request (and meet the same fault) in every run.
            later[partner].append((len(lists[partner]), Ask(op, session, title, body, "shared", partner)))
    for agent, extra in enumerate(later):
        # Insert from the back so that earlier positions stay right.
        for position, ask in sorted(extra, key=lambda pa: pa[0], reverse=True):
            lists[agent].insert(min(position, len(lists[agent])), ask)
    return Workload(agents=tuple(tuple(a) for a in lists), operations=operations)
