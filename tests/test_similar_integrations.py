"""Near-duplicate calls through an integration: what the model reads comes from ``tell_model``, with no
code of the integration's own (LangChain here, offline, on a real SQLite ledger)."""

from __future__ import annotations

from pathlib import Path

from langchain_core.tools import tool

import onceonly
from onceonly.langchain import guard


def _call(n: int, title: str) -> dict[str, object]:
    return {
        "type": "tool_call",
        "id": f"call_{n}",
        "name": "create_ticket",
        "args": {"session_id": "s1", "title": title},
    }


def test_langchain_reads_a_similar_replay_and_a_similar_error(tmp_path: Path) -> None:
    """A reworded re-plan is answered with the earlier ticket and says a similar action was done; with
    on_similar='raise' the model gets the same news as an error ToolMessage. One ticket each."""
    ledger = onceonly.Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    made: list[str] = []

    @tool
    def create_ticket(session_id: str, title: str) -> str:
        """Create a support ticket."""
        made.append(title)
        return f"ticket {len(made)}: {title}"

    sim = onceonly.Similar(fields=("title",))
    replaying = guard(create_ticket, ledger, key=("session_id", "title"), similar=sim)
    replaying.invoke(_call(1, "Printer on fire"))
    again = replaying.invoke(_call(2, "The printer is on fire!"))
    assert made == ["Printer on fire"]
    assert again.tool_call_id == "call_2"
    assert "similar action was already done" in again.content and "ticket 1: Printer on fire" in again.content

    raising = guard(create_ticket, ledger, name="raising", key=("session_id", "title"), similar=sim, on_similar="raise")
    raising.invoke(_call(3, "Email down"))
    refused = raising.invoke(_call(4, "email is down"))
    assert made == ["Printer on fire", "Email down"]
    assert refused.status == "error" and "similar action was already done" in refused.content
    assert "onceonly resolve" not in refused.content  # operator instructions stay out of what the model reads
    ledger.close()


def test_an_instrumented_ledger_looks_up_similar_calls(tmp_path: Path) -> None:
    """A ledger counted by ``onceonly.metrics`` (its store wrapped for timing) still finds a reworded
    re-plan: the wrapper hands the near-duplicate primitives to the store."""
    from prometheus_client import CollectorRegistry

    from onceonly.metrics import instrument

    ledger = onceonly.Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    instrument(ledger, registry=CollectorRegistry())
    made: list[str] = []

    @ledger.tool(key=("session_id", "title"), similar=onceonly.Similar(fields=("title",)))
    def create_ticket(session_id: str, title: str) -> str:
        made.append(title)
        return title

    first = create_ticket.outcome("s1", "Printer on fire")
    assert create_ticket.outcome("s1", "The printer is on fire!").similar_to == first.key
    assert made == ["Printer on fire"]
    ledger.close()
