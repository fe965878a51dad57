"""A guarded tool is a real function: its shape, its errors, control flow, names, and what the model is told."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest

import onceonly
from onceonly import AttemptsExhausted, InProgress, InvalidKey, KeyConflict, Ledger, OutcomeUnknown, State
from tests._clock import FakeClock


@dataclasses.dataclass
class Ticket:
    """A user type named in annotations, resolvable only in this module's globals."""

    id: int


def test_a_sync_tool_is_a_plain_function_with_the_originals_face(ledger: Ledger) -> None:
    """Name, docstring, module, qualname, annotations and signature are the original's, less the key."""

    def create_ticket(title: str, body: str = "", *, idempotency_key: str) -> Ticket:
        """Open a ticket."""
        return Ticket(len(title))

    guarded = ledger.tool(create_ticket)
    assert inspect.isfunction(guarded) and not inspect.iscoroutinefunction(guarded)
    assert guarded.__name__ == "create_ticket" and guarded.__doc__ == "Open a ticket."
    assert guarded.__module__ == __name__ and guarded.__qualname__ == create_ticket.__qualname__
    assert list(inspect.signature(guarded).parameters) == ["title", "body"]
    assert "idempotency_key" not in guarded.__annotations__
    assert not hasattr(guarded, "__wrapped__"), "unwrapping must not reach the unguarded original"
    # Annotations are strings here (from __future__ import annotations): they resolve in the user's globals.
    assert typing.get_type_hints(guarded) == {"title": str, "body": str, "return": Ticket}
    assert guarded.name == create_ticket.__qualname__ and guarded.ledger is ledger
    assert guarded("abc") == Ticket(3)
    assert guarded.outcome("abc").replayed


def test_an_async_tool_is_a_coroutine_function(ledger: Ledger) -> None:
    """inspect.iscoroutinefunction is true, so frameworks await it instead of reading a coroutine object."""
    ran: list[str] = []

    @ledger.tool
    async def send(to: str, *, idempotency_key: str) -> str:
        ran.append(to)
        return f"sent to {to}"

    assert inspect.iscoroutinefunction(send)
    assert asyncio.run(send("ann")) == "sent to ann"
    assert asyncio.run(send("ann")) == "sent to ann"
    out = asyncio.run(send.outcome("ann"))
    assert out.replayed and ran == ["ann"]
    assert list(inspect.signature(send).parameters) == ["to"]


def test_passing_idempotency_key_is_a_type_error_pointing_to_using(ledger: Ledger) -> None:
    """A caller (or a model through a framework) cannot choose the key by passing idempotency_key=."""
    ran: list[str] = []

    @ledger.tool(name="charge")
    def charge(cents: int, *, idempotency_key: str) -> str:
        ran.append(idempotency_key)
        return idempotency_key

    for call in (lambda: charge(5, idempotency_key="mine"), lambda: charge.outcome(5, idempotency_key="mine")):
        with pytest.raises(TypeError, match=r"\.using\(key="):
            call()
    assert ran == []
    assert charge.using(key="order-7")(5) == "default:charge:order-7"


def test_an_empty_explicit_key_is_refused_not_replaced(ledger: Ledger) -> None:
    """using(key="") is a mistake, not "derive the key": it raises instead of falling back silently."""

    @ledger.tool(name="op")
    def op(n: int) -> int:
        return n

    with pytest.raises(InvalidKey, match="empty"):
        op.using(key="")(1)


@pytest.mark.parametrize("returned", [None, ""])
def test_a_key_function_returning_nothing_is_an_error(ledger: Ledger, returned: Any) -> None:
    """key= returning None (or "") would make every such call share the key "None": it is refused."""
    ran: list[int] = []

    @ledger.tool(name="op", key=lambda args: returned)
    def op(n: int) -> int:
        ran.append(n)
        return n

    with pytest.raises(InvalidKey, match="returned"):
        op(1)
    assert ran == [] and ledger.list() == []


def test_decorating_a_framework_tool_object_names_the_integration(ledger: Ledger) -> None:
    """A LangChain tool object is not a function to decorate: the error says what to use."""
    from langchain_core.tools import tool

    @tool
    def lookup(q: str) -> str:
        """Look up."""
        return q

    with pytest.raises(TypeError, match=r"onceonly\.langchain\.guard"):
        ledger.tool(lookup)


# --- names --------------------------------------------------------------------------------------


def test_a_second_function_under_a_registered_name_is_refused(ledger: Ledger) -> None:
    """Factory-made tools get one default name: the second is refused rather than replaying the first's result."""
    sent: list[tuple[str, str]] = []

    def notifier(channel: str) -> Any:
        @ledger.tool
        def notify(text: str) -> str:
            sent.append((channel, text))
            return channel

        return notify

    ops = notifier("ops")
    assert ops("disk full") == "ops"
    with pytest.raises(ValueError, match="name="):
        notifier("sales")
    assert notifier("ops")("disk full") == "ops", "the same definition again is the same operation"
    assert sent == [("ops", "disk full")]

    @ledger.tool(name="notify-sales")
    def notify(text: str) -> str:
        sent.append(("sales", text))
        return "sales"

    assert notify("disk full") == "sales"


def test_the_same_function_gets_one_name_as_a_script_and_imported(tmp_path: Path) -> None:
    """Run directly (__main__) and imported, one function is one tool: the second run replays."""
    (tmp_path / "qs.py").write_text(
        textwrap.dedent(
            f"""
            import onceonly

            ledger = onceonly.Ledger.open("sqlite:///{tmp_path}/ledger.db")

            @ledger.tool
            def create_ticket(title: str) -> dict:
                with open("{tmp_path}/effects", "a") as f:
                    f.write(title + "\\n")
                return {{"title": title}}

            def main():
                print(create_ticket("Printer on fire"))

            if __name__ == "__main__":
                main()
            """
        )
    )
    for argv in (["qs.py"], ["-c", "import qs; qs.main()"]):
        subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, check=True, timeout=60)
    assert (tmp_path / "effects").read_text().splitlines() == ["Printer on fire"]


# --- control flow is not an outcome ----------------------------------------------------------------


def test_a_langgraph_interrupt_releases_the_claim_without_an_attempt(ledger: Ledger) -> None:
    """GraphInterrupt passes through unrecorded: the resumed call runs again, and pauses never exhaust attempts."""
    from langgraph.errors import GraphInterrupt

    effects: list[int] = []
    approved: list[bool] = []

    @ledger.tool(name="pay", retry=onceonly.Retry(attempts=3))
    def pay(cents: int) -> str:
        if not approved:
            raise GraphInterrupt(())
        effects.append(cents)
        return f"paid {cents}"

    for _ in range(5):  # more pauses than attempts
        with pytest.raises(GraphInterrupt):
            pay(500)
    rec = ledger.get(pay.key_for(500))
    assert rec is not None and rec.state is State.FAILED and rec.attempts == 0 and rec.error is None
    approved.append(True)
    assert pay(500) == "paid 500"
    assert pay(500) == "paid 500"
    rec = ledger.get(pay.key_for(500))
    assert effects == [500] and rec is not None and rec.state is State.CONFIRMED and rec.attempts == 1


def test_passthrough_names_more_control_flow(ledger: Ledger) -> None:
    """passthrough= types propagate uncounted (sync and async); other errors still count as attempts."""

    class Redirect(Exception):
        pass

    calls: list[str] = []

    @ledger.tool(name="hop", passthrough=(Redirect,), retry=onceonly.Retry(attempts=1))
    async def hop(to: str) -> str:
        calls.append(to)
        if len(calls) < 3:
            raise Redirect(to)
        return to

    for _ in range(2):
        with pytest.raises(Redirect):
            asyncio.run(hop("b"))
    assert asyncio.run(hop("b")) == "b"
    with pytest.raises(TypeError, match="exception types"):
        ledger.tool(name="bad", passthrough=("Redirect",))(lambda: None)  # type: ignore[arg-type]


# --- what the model is told -------------------------------------------------------------------


def test_tell_model_says_a_replay_was_not_repeated_with_when_and_result(ledger: Ledger, clock: FakeClock) -> None:
    """The replay text says when it was done, that it was not repeated, and the result; a fresh run is the result."""

    @ledger.tool(name="create")
    def create(title: str) -> dict[str, Any]:
        return {"id": 7, "title": title}

    first = create.outcome("x")
    assert onceonly.tell_model(first) == '{"id":7,"title":"x"}'
    again = create.outcome("x")
    text = onceonly.tell_model(again)
    assert "already done at " in text and "not repeated" in text and '{"id":7,"title":"x"}' in text
    assert "onceonly resolve" not in text


def test_tell_model_for_errors_never_gives_operator_instructions(ledger: Ledger) -> None:
    """Unknown, in progress, conflict and exhausted each get short model text; resolve commands stay in the error."""

    @ledger.tool(name="send", on_unknown="review")
    def send(to: str) -> str:
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown) as unknown:
        send("ann")
    assert "onceonly resolve" in str(unknown.value)
    told = onceonly.tell_model(unknown.value)
    assert "unknown" in told and "Do not issue it again" in told and "resolve" not in told

    @ledger.tool(name="mail", key=("to",))
    def mail(to: str, body: str) -> str:
        return f"mailed {body}"

    mail("ann", "hello")
    with pytest.raises(KeyConflict) as conflict:
        mail("ann", "hello again")
    told = onceonly.tell_model(conflict.value)
    assert "other details" in told and "mailed hello" in told and "resolve" not in told

    @ledger.tool(name="refused", retry=onceonly.Retry(attempts=1))
    def refused(n: int) -> int:
        raise ConnectionRefusedError("nobody listens")

    with pytest.raises(AttemptsExhausted) as exhausted:
        refused(1)
    told = onceonly.tell_model(exhausted.value)
    assert "will not be retried" in told and "nobody listens" in told and "resolve" not in told

    busy = InProgress("held", key="k")
    assert "in progress" in onceonly.tell_model(busy)
    later = onceonly.RetryScheduled("due later", key="k", retry_at=1_800_000_000.0)
    told = onceonly.tell_model(later)
    assert "has not happened" in told and "at 2027-01-15T08:00:00Z" in told and "in progress" not in told
    assert json.dumps(onceonly.tell_model(ValueError("bad")))  # plain text for anything else


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1, 2}])
def test_resolve_refuses_a_result_with_no_strict_json_form(ledger: Ledger, value: Any) -> None:
    """A person's stated result is stored as given or refused: never replaced by a description."""

    @ledger.tool(name="send")
    def send(to: str) -> str:
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown):
        send("ann")
    key = send.key_for("ann")
    with pytest.raises(onceonly.NotSerializable, match="confirmed"):
        ledger.resolve(key, confirmed=value)
    rec = ledger.get(key)
    assert rec is not None and rec.state is State.NEEDS_REVIEW
