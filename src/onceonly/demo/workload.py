"""What the demo's agents ask for, drawn from one seed. Pure, no I/O.

An *operation* is one ticket an agent means to create: a session and a title (the business key). An
*ask* is one call of the agent's tool for it. Most operations are asked once; two patterns ask again:

- re-planning: the same agent asks for the same ticket a few steps later, the body re-worded (an LLM
  that lost track of what it did, or re-planned after an error);
- shared: a second agent of the same session asks for the same ticket at about the same time.

The same seed gives the same asks, in the same order per agent, to every strategy. Each decision is
a named draw (``uniform(seed, what, op)``), not the next number of one generator: adding a kind of
decision leaves the others as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

from onceonly.tickets.faults import uniform

__all__ = ["Ask", "Workload", "make_workload"]

_TOPICS = (
    "Printer on fire", "VPN drops every hour", "Refund order", "Reset password", "Laptop will not boot",
    "Invoice has the wrong address", "Disk almost full", "Access to the finance share", "Broken monitor",
    "Phone lost", "Badge does not open door", "Slow Wi-Fi on floor", "Update the payroll bank account",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ask:
    """One call of an agent's tool: create the ticket ``(session_id, title)`` with ``body``.

    Attributes:
        op: the operation's index (asks of the same operation share it).
        kind: ``"first"``, ``"replan"`` (the same agent again, body re-worded) or ``"shared"`` (another
            agent of the session).
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

    def keys(self) -> list[tuple[str, str]]:
        """The business key of each operation, by its index."""
        found: dict[int, tuple[str, str]] = {}
        for agent in self.agents:
            for ask in agent:
                found.setdefault(ask.op, (ask.session_id, ask.title))
        return [found[n] for n in range(self.operations)]


def make_workload(
    *, seed: int, agents: int, operations: int, replan_rate: float = 0.1, shared_rate: float = 0.1
) -> Workload:
    """Draw the asks of ``agents`` agents for ``operations`` tickets from ``seed``.

    Agents ``2k`` and ``2k+1`` work in one session (a planner and a worker), so that a shared
    ticket is asked by two agents of the same session.
    """
    if agents < 1 or operations < 1:
        raise ValueError(f"agents={agents}, operations={operations}: at least one of each")
    if not (0 <= replan_rate <= 1 and 0 <= shared_rate <= 1):
        raise ValueError("replan_rate and shared_rate are probabilities between 0 and 1")
    lists: list[list[Ask]] = [[] for _ in range(agents)]
    later: list[list[tuple[int, Ask]]] = [[] for _ in range(agents)]  # (position, ask) to insert
    for op in range(operations):
        agent = op % agents
        session = f"s{seed}-{agent // 2}"
        title = f"{_TOPICS[int(uniform(seed, 'topic', op) * len(_TOPICS))]} #{op}"
        body = f"Reported by agent {agent}: {title.lower()}, please look into it."
        first = Ask(op, session, title, body, "first", agent)
        lists[agent].append(first)
        position = len(lists[agent])
        if uniform(seed, "replan", op) < replan_rate:
            reworded = Ask(op, session, title, f"{body} (Re-planned: the user asked again.)", "replan", agent)
            later[agent].append((position + 1 + int(uniform(seed, "replan-after", op) * 4), reworded))
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
