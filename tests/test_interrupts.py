"""A guarded call stopped from outside, a tool that calls itself, and what an unknown outcome says of its
cause, on every store.

An interrupt (``KeyboardInterrupt``, ``SystemExit``, a cancelled async caller) inside a guarded call
records the attempt at once: ``unknown`` (the interruption may have come after the send), or ``failed``
before a reported dispatch (nothing was sent), and re-raises the interrupt. A call of an operation made
inside that operation's own running call is refused at once (``ReentrantCall``) instead of waiting
``wait`` seconds on its own claim. An ``OutcomeUnknown`` names why the outcome is unknown.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

import onceonly
from onceonly import Ledger, OutcomeUnknown, ReentrantCall, State
from onceonly import states as st

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(name="real")
def fixture_real(store_url: str) -> Any:
    """A ledger on the real clock (leases are compared with it) on each store."""
    ledger = Ledger.open(store_url)
    yield ledger
    ledger.close()


# --- interrupts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_a_tool_leaves_the_record_unknown_at_once(real: Ledger, interrupt: type) -> None:
    """``KeyboardInterrupt`` inside a tool left its record ``in_flight`` until the 30 s lease ran out, so
    every caller meanwhile waited on a call that was over. The record reads unknown at once, saying
    what interrupted it, and the interrupt goes on up; a probe then settles it without a second run."""
    ran: list[int] = []

    @real.tool(name="charge", lease=30, on_unknown="probe", probe=lambda args, key: {"charged": ran[0]})
    def charge(n: int) -> dict[str, int]:
        ran.append(n)
        raise interrupt()

    with pytest.raises(interrupt):
        charge(7)
    rec = real.get(charge.key_for(7))
    assert rec is not None and rec.state is State.UNKNOWN and rec.lease_owner is None, rec
    assert interrupt.__name__ in rec.history[-1]["reason"]
    assert charge.outcome(7).result == {"charged": 7} and ran == [7]


def test_an_interrupt_before_a_reported_dispatch_is_not_sent(real: Ledger) -> None:
    """A tool that reports its dispatch, interrupted before it: nothing was sent, so the record is
    failed as not sent (not unknown), and the next call runs it at once."""
    ran: list[str] = []

    @real.tool(name="notify", reports_dispatch=True, lease=30)
    def notify(to: str) -> str:
        ran.append(to)
        if len(ran) == 1:
            raise KeyboardInterrupt
        onceonly.mark_sent()
        return f"sent to {to}"

    with pytest.raises(KeyboardInterrupt):
        notify("ada")
    rec = real.get(notify.key_for("ada"))
    assert rec is not None and rec.state is State.FAILED and not st.may_have_happened(rec), rec
    assert notify("ada") == "sent to ada" and ran == ["ada", "ada"]


def test_an_interrupt_in_a_tool_with_a_timeout_leaves_it_unknown_at_once(real: Ledger) -> None:
    """With ``timeout=`` the tool runs in a worker thread; an interrupt raised there was re-raised with
    the record left in flight. It is unknown at once too."""

    @real.tool(name="slow", timeout=5, lease=30)
    def slow() -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        slow()
    rec = real.get(slow.key_for())
    assert rec is not None and rec.state is State.UNKNOWN, rec


_CTRL_C = textwrap.dedent(
    """
    import json, signal, sys, threading, time
    from onceonly import Ledger
    ledger = Ledger.open(sys.argv[1])

    @ledger.tool(name="slow", timeout=10, lease=30)
    def slow() -> str:
        time.sleep(1.0)
        return "done"

    main = threading.main_thread().ident
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    try:
        slow()
    except KeyboardInterrupt:
        at_once = ledger.get(slow.key_for()).state.value
    time.sleep(1.5)  # the tool runs on in its thread: its late result is recorded
    rec = ledger.get(slow.key_for())
    print(json.dumps([at_once, rec.state.value, rec.via]))
    """
)


def test_ctrl_c_while_a_caller_waits_on_a_tool_with_a_timeout(store_url: str) -> None:
    """Ctrl-C while the caller waited for a tool with ``timeout=``: the heartbeats went on extending the
    lease while the tool ran on unrecorded. The record is unknown at once, and the tool's late result
    confirms it (``late:1``), as after a timeout. In a process of its own: a real SIGINT to its main
    thread."""
    out = subprocess.run(
        [sys.executable, "-c", _CTRL_C, store_url], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["unknown", "confirmed", "late:1"]


def test_a_cancelled_async_caller_leaves_the_record_unknown_at_once(store_url: str) -> None:
    """A cancelled caller left the record in flight with no heartbeat while the tool ran on. It is unknown
    at once, and the tool (which a cancelled caller does not cancel) still confirms it with its result."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        finished = asyncio.Event()

        @ledger.tool(name="acharge", lease=30)
        async def acharge() -> str:
            await asyncio.sleep(0.3)
            finished.set()
            return "charged"

        caller = asyncio.ensure_future(acharge())
        await asyncio.sleep(0.1)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        rec = ledger.get(acharge.key_for())
        assert rec is not None and rec.state is State.UNKNOWN and "CancelledError" in rec.history[-1]["reason"]
        await asyncio.wait_for(finished.wait(), 5)
        for _ in range(100):
            await asyncio.sleep(0.02)
            rec = ledger.get(acharge.key_for())
            if rec is not None and rec.state is State.CONFIRMED:
                break
        assert rec is not None and rec.state is State.CONFIRMED and rec.via == "late:1"
        ledger.close()

    asyncio.run(main())


def test_an_event_loop_stopped_mid_call_leaves_the_record_unknown(store_url: str) -> None:
    """``asyncio.run`` ending with a guarded call in flight (Ctrl-C, a main that returned) cancels the
    caller and then the tool's own task: the record stayed in flight until its lease ran out. It is
    unknown when ``asyncio.run`` returns."""
    ledger = Ledger.open(store_url)
    started = threading.Event()

    @ledger.tool(name="along", lease=30)
    async def along() -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    async def main() -> None:
        left = asyncio.ensure_future(along())  # left running: asyncio.run cancels it on the way out
        while not started.is_set():
            await asyncio.sleep(0.01)
        assert not left.done()

    try:
        asyncio.run(main())
        rec = ledger.get(along.key_for())
        assert rec is not None and rec.state is State.UNKNOWN, rec
    finally:
        ledger.close()


# --- a tool that calls itself ---------------------------------------------------------------------------


def test_a_tool_that_calls_itself_with_the_same_key_is_refused_at_once(real: Ledger) -> None:
    """A tool calling itself with the same arguments waited the whole ``wait`` on its own claim, then
    raised ``InProgress`` blaming another caller. The inner call is refused at once with
    ``ReentrantCall``, which names the key and says what to do; the inner call runs nothing."""
    ran: list[int] = []

    @real.tool(name="book", wait=5)
    def book(n: int) -> int:
        ran.append(n)
        return book(n)  # the same key: the same operation, inside its own call

    started = time.monotonic()
    with pytest.raises(ReentrantCall) as info:
        book(1)
    assert time.monotonic() - started < 2
    assert ran == [1]
    message = str(info.value)
    assert info.value.key == book.key_for(1) and book.key_for(1) in message
    assert "itself" in message and "another caller" not in message
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is ReentrantCall and str(again) == message and again.key == info.value.key


def test_a_call_back_through_another_tool_is_refused_and_other_keys_run(real: Ledger) -> None:
    """A calls B, B calls A again with A's key: refused at once too. A tool calling itself with other
    arguments (another key) is a call of its own, and runs."""
    ran: list[str] = []

    @real.tool(name="outer", wait=5)
    def outer(depth: int) -> str:
        ran.append(f"outer {depth}")
        if depth == 0:
            return outer(1)  # another key: runs
        return inner()

    @real.tool(name="inner", wait=5)
    def inner() -> str:
        ran.append("inner")
        return outer(1)  # outer(1) is running above: re-entry

    started = time.monotonic()
    with pytest.raises(ReentrantCall):
        outer(0)
    assert time.monotonic() - started < 2
    assert ran == ["outer 0", "outer 1", "inner"]


def test_an_async_tool_that_calls_itself_is_refused_at_once(store_url: str) -> None:
    """The same for an ``async def`` tool, whose own task is the inner call's context."""

    async def main() -> None:
        ledger = Ledger.open(store_url)

        @ledger.tool(name="abook", wait=5)
        async def abook(n: int) -> int:
            return await abook(n)

        started = time.monotonic()
        with pytest.raises(ReentrantCall):
            await abook(1)
        assert time.monotonic() - started < 2
        ledger.close()

    asyncio.run(main())


def test_another_thread_is_another_caller_and_waits(real: Ledger) -> None:
    """A call of the same key from another thread (not inside the running call) is single-flight as
    before: it waits for the holder's result, and is not refused."""
    release = threading.Event()
    ran: list[int] = []

    @real.tool(name="hold", wait=5)
    def hold() -> str:
        ran.append(1)
        release.wait(5)
        return "held"

    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(hold.outcome()))
    first.start()
    while not ran:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: got.append(hold.outcome()))
    second.start()
    time.sleep(0.2)
    release.set()
    first.join(10)
    second.join(10)
    assert ran == [1] and sorted(o.replayed for o in got) == [False, True]


# --- what an unknown outcome says of its cause -------------------------------------------------------------


def _planted_expired(ledger: Ledger, tool: Any) -> None:
    """The record of ``tool()`` as a caller that died mid-attempt left it: in flight, its lease run out."""
    now = time.time()
    call = tool.spec.call((), {}, None, 1)
    rec = st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        state=State.IN_FLIGHT, owner="gone-host:4242:1", now=now - 60, lease_seconds=30,
    )  # fmt: skip
    assert ledger.store.insert(rec)


class _Response:
    """A response that came back 502, as httpx's and requests' errors carry it."""

    status_code = 502
    headers: ClassVar[dict[str, str]] = {}


class _BadGateway(Exception):
    """An HTTP client's error for a response that came back 502."""

    response = _Response()


@pytest.mark.parametrize("cause", ["lease", "timeout", "lost answer", "upstream"])
def test_an_unknown_outcome_names_its_cause(real: Ledger, cause: str) -> None:
    """An ``OutcomeUnknown`` after an expired lease said only that the outcome was unknown. It names why:
    the lease of the caller that ran it ran out, the attempt timed out, its answer was lost, or the
    other side answered with an upstream error. What a model reads (``tell_model``) keeps to what it
    should do, with no operator command."""

    @real.tool(name=f"op-{cause.replace(' ', '-')}", timeout=0.05 if cause == "timeout" else None)
    def op() -> str:
        if cause == "timeout":
            time.sleep(0.3)
        elif cause == "lost answer":
            raise ConnectionResetError("connection reset by peer")
        elif cause == "upstream":
            raise _BadGateway("502 Bad Gateway")
        return "done"

    if cause == "lease":
        _planted_expired(real, op)
    with pytest.raises(OutcomeUnknown) as info:
        op()
    message = str(info.value)
    expected = {
        "lease": ["lease of gone-host:4242:1 ran out"],
        "timeout": ["timed out"],
        "lost answer": ["answer was lost", "ConnectionResetError"],
        "upstream": ["upstream error", "HTTP 502"],
    }[cause]
    for words in expected:
        assert words in message, message
    told = onceonly.tell_model(info.value)
    assert "onceonly resolve" not in told and "unknown" in told
