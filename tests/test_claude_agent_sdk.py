"""onceonly.claude_agent_sdk: in-process MCP tools that act once per Claude session, called by the real
Claude Code CLI that the SDK bundles.

The CLI talks to a local fake Messages API (tests/_fake_messages_api.py, a real HTTP server on 127.0.0.1)
that answers from a script and keeps every request, so each test reads what the model was shown: the
``tool_result`` blocks the CLI sent back. Side effects are rows in a SQLite table of the test's own, so
each scenario shows the duplicate without onceonly and its absence with it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("claude_agent_sdk")

import claude_agent_sdk as sdk
from claude_agent_sdk import (
    ClaudeAgentOptions,
    ClaudeSDKClient,
    PermissionResultAllow,
    PermissionResultDeny,
    ResultMessage,
    ToolPermissionContext,
)

import onceonly
from onceonly import Ledger, edge
from onceonly.claude_agent_sdk import SETTING, create_sdk_mcp_server, guard, session_hooks, session_scope
from tests._fake_messages_api import FakeMessagesApi, claude_env, text, tool_results, tool_use

pytestmark = pytest.mark.timeout(240)

CHARGE = "mcp__billing__charge"
UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"
IN_PROGRESS = "already in progress"


class Charges:
    """The side effect: one row per charge made, in a SQLite file; and the scope each call ran under."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scopes: list[str | None] = []
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS charges (customer TEXT, cents INTEGER)")

    def add(self, customer: str, cents: int) -> int:
        call = onceonly.current_call()
        self.scopes.append(None if call is None else call.scope)
        with sqlite3.connect(self.path) as conn:
            cur = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents))
        return int(cur.lastrowid or 0)

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0])


@pytest.fixture(name="charges")
def fixture_charges(tmp_path: Path) -> Charges:
    return Charges(tmp_path / "charges.db")


@pytest.fixture(name="ledger")
def fixture_ledger(tmp_path: Path) -> Any:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


Turn = list[tuple[str, dict[str, Any]]] | str


def scripted(*turns: Turn) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """A model that gives the n-th turn at its n-th answer: a text, or tool calls (fresh tool-use ids each
    time, so that two sessions never share one); then says it is done."""

    def answer(body: dict[str, Any]) -> list[dict[str, Any]]:
        n = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        turn = turns[n] if n < len(turns) else "done"
        if isinstance(turn, str):
            return [text(turn)]
        return [tool_use(name, args) for name, args in turn]

    return answer


def charge_call(customer: str = "ada", cents: Any = 500) -> tuple[str, dict[str, Any]]:
    return (CHARGE, {"customer": customer, "cents": cents})


async def session(
    api: FakeMessagesApi,
    home: Path,
    server: Any,
    *,
    hooks: bool = True,
    can_use_tool: Any = None,
    prompt: str = "charge ada 5 dollars",
    resume: str | None = None,
    own_hooks: dict[Any, Any] | None = None,
    results: list[ResultMessage] | None = None,
) -> str:
    """One Claude session, through the real CLI: its session id."""
    options = ClaudeAgentOptions(
        mcp_servers={"billing": server},
        allowed_tools=[] if can_use_tool is not None else [CHARGE],
        can_use_tool=can_use_tool,
        hooks=session_hooks(own_hooks) if hooks else own_hooks,  # type: ignore[arg-type]
        env=claude_env(api.url, home),
        cwd=str(home),
        model="claude-sonnet-4-5",
        setting_sources=[],
        resume=resume,
    )
    session_id = ""
    async with ClaudeSDKClient(options) as client:
        await client.query(prompt)
        async for message in client.receive_response():
            if isinstance(message, ResultMessage):
                session_id = message.session_id
                if results is not None:
                    results.append(message)
    return session_id


def results_of(api: FakeMessagesApi) -> list[dict[str, Any]]:
    return tool_results(api.requests[-1])


@pytest.fixture(name="home")
def fixture_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def plain_server(fn: Callable[..., Any]) -> Any:
    """The same function served without onceonly: the SDK's own @tool and create_sdk_mcp_server."""

    @sdk.tool("charge", "Charge a customer.", {"customer": str, "cents": int})
    async def charge(args: dict[str, Any]) -> dict[str, Any]:
        try:
            out = fn(args["customer"], args["cents"])
            if asyncio.iscoroutine(out):
                out = await out
        except Exception as exc:
            return {"content": [{"type": "text", "text": str(exc)}], "is_error": True}
        return {"content": [{"type": "text", "text": str(out)}]}

    return sdk.create_sdk_mcp_server("billing", tools=[charge])


# --- a lost answer, re-issued ---------------------------------------------------------------------


def lost_answer(charges: Charges) -> Callable[[str, int], str]:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        charges.add(customer, cents)
        raise TimeoutError("the payment service did not answer")  # after the charge was made

    return charge


def test_a_lost_answer_reissued_charges_once_and_the_model_reads_unknown(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    script = scripted([charge_call()], [charge_call()])
    with FakeMessagesApi(script) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [lost_answer(charges)], ledger)))
    assert charges.count() == 1
    first, second = results_of(api)
    assert UNKNOWN in first["text"] and first["is_error"]
    assert UNKNOWN in second["text"] and second["is_error"]
    for result in (first, second):  # never the operator's text
        assert "onceonly resolve" not in result["text"] and "TimeoutError" not in result["text"]


def test_without_onceonly_a_lost_answer_reissued_charges_twice(charges: Charges, home: Path) -> None:
    script = scripted([charge_call()], [charge_call()])
    with FakeMessagesApi(script) as api:
        asyncio.run(session(api, home, plain_server(lost_answer(charges))))
    assert charges.count() == 2
    assert "did not answer" in results_of(api)[0]["text"]


# --- a replay ---------------------------------------------------------------------------------------


def test_a_reissued_async_call_replays_and_the_model_reads_it_was_not_repeated(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)} for {cents} cents"

    # "500" and 500.0 are the integer 500 to the tool: one charge.
    script = scripted([charge_call(cents=500)], [charge_call(cents="500")], [charge_call(cents=500.0)])
    with FakeMessagesApi(script) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger)))
    assert charges.count() == 1
    first, *replays = results_of(api)
    assert first["text"].startswith("charge 1 for 500 cents") and not first["is_error"]
    for replay in replays:
        assert NOT_REPEATED in replay["text"] and "charge 1 for 500 cents" in replay["text"]
        assert not replay["is_error"]


def test_without_onceonly_a_reissued_call_charges_again(charges: Charges, home: Path) -> None:
    def charge(customer: str, cents: int) -> str:
        return f"charge {charges.add(customer, cents)}"

    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:
        asyncio.run(session(api, home, plain_server(charge)))
    assert charges.count() == 2


def test_an_at_ledger_tool_function_keeps_its_settings(ledger: Ledger, charges: Charges, home: Path) -> None:
    @ledger.tool(key=("customer",))  # one charge per customer, whatever the amount
    def charge(customer: str, cents: int) -> dict[str, Any]:
        """Charge a customer."""
        return {"charge": charges.add(customer, cents), "cents": cents}

    with FakeMessagesApi(scripted([charge_call(cents=500)], [charge_call(cents=700)])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger)))
    assert charges.count() == 1
    first, second = results_of(api)
    assert first["text"].startswith('{"charge": 1, "cents": 500}')
    assert "other details, and was not repeated" in second["text"] and second["is_error"]
    with pytest.raises(TypeError, match="its settings are its decorator's"):
        guard(charge, ledger, timeout=5)


# --- two identical calls in one turn ----------------------------------------------------------------


def test_two_identical_calls_in_one_turn_charge_once(ledger: Ledger, charges: Charges, home: Path) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    with FakeMessagesApi(scripted([charge_call(), charge_call()])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger)))
    assert charges.count() == 1
    texts = sorted(r["text"] for r in results_of(api))
    assert len(texts) == 2
    assert sum(t.startswith("charge 1") for t in texts) == 1
    assert sum(NOT_REPEATED in t or IN_PROGRESS in t for t in texts) == 1


def test_without_onceonly_two_identical_calls_in_one_turn_charge_twice(charges: Charges, home: Path) -> None:
    def charge(customer: str, cents: int) -> str:
        return f"charge {charges.add(customer, cents)}"

    with FakeMessagesApi(scripted([charge_call(), charge_call()])) as api:
        asyncio.run(session(api, home, plain_server(charge)))
    assert charges.count() == 2


# --- who is calling ---------------------------------------------------------------------------------


def test_two_sessions_with_the_same_arguments_charge_twice_each_under_its_session(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    server = create_sdk_mcp_server("billing", [charge], ledger)  # one server, shared by both clients
    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:

        async def both() -> list[str]:
            return [await session(api, home, server), await session(api, home, server)]

        ids = asyncio.run(both())
    assert charges.count() == 2
    assert ids[0] != ids[1]
    assert charges.scopes == [session_scope(ids[0]), session_scope(ids[1])]
    for sid in ids:  # each session's re-issue replayed its own charge
        assert len(ledger.list(scope=session_scope(sid))) == 1


def test_two_sessions_at_once_with_the_same_arguments_charge_twice(
    ledger: Ledger, charges: Charges, tmp_path: Path
) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    server = create_sdk_mcp_server("billing", [charge], ledger)
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    for h in homes:
        h.mkdir()
    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:

        async def both() -> list[str]:
            return list(await asyncio.gather(*(session(api, h, server) for h in homes)))

        ids = asyncio.run(both())
    assert charges.count() == 2
    assert sorted(charges.scopes) == sorted(session_scope(i) for i in ids)


def test_a_resumed_session_replays_its_earlier_call(ledger: Ledger, charges: Charges, home: Path) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    server = create_sdk_mcp_server("billing", [charge], ledger)
    with FakeMessagesApi(scripted([charge_call()], "charged", [charge_call()])) as api:

        async def twice() -> list[str]:
            first = await session(api, home, server)
            return [first, await session(api, home, server, prompt="did it go through?", resume=first)]

        ids = asyncio.run(twice())
    assert ids[0] == ids[1]  # the CLI resumes the session under its id
    assert charges.count() == 1
    assert NOT_REPEATED in results_of(api)[-1]["text"]


def test_a_ledger_task_around_the_clients_wins(ledger: Ledger, charges: Charges, home: Path) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    server = create_sdk_mcp_server("billing", [charge], ledger)
    with FakeMessagesApi(scripted([charge_call()])) as api:

        async def both() -> None:
            with ledger.task("order-77"):  # one conversation the application names, over two sessions
                await session(api, home, server)
                await session(api, home, server)

        asyncio.run(both())
    assert charges.count() == 1
    assert charges.scopes == ["order-77"]
    assert NOT_REPEATED in results_of(api)[0]["text"]


def test_without_the_session_hook_a_call_is_scoped_to_its_connection_with_one_warning(
    ledger: Ledger, charges: Charges, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    edge._warned.discard(("claude-agent-sdk", SETTING))  # the warning is once per process
    server = create_sdk_mcp_server("billing", [charge], ledger)
    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api, caplog.at_level("WARNING", "onceonly"):

        async def both() -> None:
            await session(api, home, server, hooks=False)
            await session(api, home, server, hooks=False)

        asyncio.run(both())
    assert charges.count() == 2  # a re-issue inside a client replays; another client runs its own
    assert len(set(charges.scopes)) == 2
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and "session_hooks()" in warnings[0].getMessage()


def test_a_guarded_tool_under_the_sdks_own_server_runs_only_inside_a_ledger_task(
    ledger: Ledger, charges: Charges, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    server = sdk.create_sdk_mcp_server("billing", tools=[guard(charge, ledger)])
    with FakeMessagesApi(scripted([charge_call()])) as api, caplog.at_level("ERROR", "onceonly"):
        asyncio.run(session(api, home, server))
        refused = results_of(api)[0]

        async def in_task() -> None:
            with ledger.task("order-78"):
                await session(api, home, server)

        asyncio.run(in_task())
    assert refused["is_error"] and "not run" in refused["text"]
    assert any("create_sdk_mcp_server" in r.getMessage() for r in caplog.records)
    assert charges.count() == 1 and charges.scopes == ["order-78"]


# --- what the model is shown ------------------------------------------------------------------------


def test_the_schema_the_model_is_shown_has_no_idempotency_key(ledger: Ledger, charges: Charges, home: Path) -> None:
    seen: list[str] = []

    def charge(customer: str, cents: int, idempotency_key: str = "") -> str:
        """Charge a customer."""
        seen.append(idempotency_key)
        return f"charge {charges.add(customer, cents)}"

    with FakeMessagesApi(scripted([charge_call()])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger)))
    (shown,) = [t for t in api.requests[0]["tools"] if t["name"] == CHARGE]
    assert set(shown["input_schema"]["properties"]) == {"customer", "cents"}
    assert "idempotency_key" not in str(shown)
    assert shown["description"] == "Charge a customer."
    assert len(seen) == 1 and seen[0]  # the ledger filled it in


# --- an SdkMcpTool's own error result ----------------------------------------------------------------


def test_an_sdk_tools_error_result_after_it_acted_is_unknown(ledger: Ledger, charges: Charges, home: Path) -> None:
    @sdk.tool("charge", "Charge a customer.", {"customer": str, "cents": int})
    async def charge(args: dict[str, Any]) -> dict[str, Any]:
        charges.add(args["customer"], args["cents"])
        return {"content": [{"type": "text", "text": "gateway error"}], "is_error": True}

    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger)))
    assert charges.count() == 1
    assert all(UNKNOWN in r["text"] and r["is_error"] for r in results_of(api))


# --- the SDK's permission denial --------------------------------------------------------------------


def test_a_denied_call_is_not_claimed_and_a_later_allowed_one_runs_once(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    asked: list[str] = []

    async def permit(name: str, args: dict[str, Any], context: ToolPermissionContext) -> Any:
        asked.append(name)
        if len(asked) == 1:
            return PermissionResultDeny(message="not now")
        return PermissionResultAllow()

    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [charge], ledger), can_use_tool=permit))
    denied, allowed = results_of(api)
    assert asked == [CHARGE, CHARGE]
    assert "not now" in denied["text"] and denied["is_error"]
    assert allowed["text"].startswith("charge 1") and not allowed["is_error"]  # ran now, not a replay
    assert charges.count() == 1
    assert [r.state.value for r in ledger.list()] == ["confirmed"]


def test_a_deferred_call_is_not_claimed_and_runs_once_when_the_session_resumes(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    """A PreToolUse hook's "defer" stops the run before the tool runs; resuming the session runs the
    deferred call: once, as a fresh call, not as a replay or an unknown."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        return f"charge {charges.add(customer, cents)}"

    deferring = [True]

    async def defer(hook_input: Any, tool_use_id: str | None, context: Any) -> dict[str, Any]:
        if deferring[0]:
            return {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "defer"}}
        return {}

    hooks = {"PreToolUse": [sdk.HookMatcher(matcher=None, hooks=[defer])]}
    server = create_sdk_mcp_server("billing", [charge], ledger)
    ended: list[ResultMessage] = []
    with FakeMessagesApi(scripted([charge_call()])) as api:

        async def deferred_then_resumed() -> None:
            sid = await session(api, home, server, own_hooks=hooks, results=ended)
            assert charges.count() == 0 and ledger.list() == []  # paused before the tool: nothing claimed
            deferring[0] = False
            await session(api, home, server, own_hooks=hooks, resume=sid, prompt="")

        asyncio.run(deferred_then_resumed())
    assert ended[0].stop_reason == "tool_deferred" and ended[0].deferred_tool_use is not None
    assert charges.count() == 1
    (ran,) = results_of(api)
    assert ran["text"].startswith("charge 1") and not ran["is_error"]
    assert [r.state.value for r in ledger.list()] == ["confirmed"]


def test_guard_tools_refuses_what_it_cannot_guard(ledger: Ledger) -> None:
    @sdk.tool("book", "Book.", {"type": "object", "properties": {"idempotency_key": {"type": "string"}}})
    async def book(args: dict[str, Any]) -> dict[str, Any]:
        return {"content": []}

    with pytest.raises(TypeError, match="idempotency_key"):
        guard(book, ledger)
    made = guard(lambda x: x, ledger, name="echo")
    with pytest.raises(TypeError, match="guarded already"):
        guard(made, ledger)
    assert guard(book_plain, ledger) is guard(book_plain, ledger)  # one definition under one name

    @sdk.tool("refund", "Refund.", {"order": str})
    async def refund(args: dict[str, Any]) -> dict[str, Any]:
        return {"content": []}

    renamed = guard(refund, ledger, name="refund_order")
    assert (renamed.name, renamed.description) == ("refund_order", "Refund.")
    assert renamed.input_schema == {
        "type": "object",
        "properties": {"order": {"type": "string"}},
        "required": ["order"],
    }


def book_plain(room: str) -> str:
    return room


# --- the example --------------------------------------------------------------------------------------


def test_example_charges_once_and_tells_the_model(tmp_path: Path) -> None:
    """examples/claude_agent_sdk_agent.py runs offline, through the real CLI: two charges without onceonly,
    one with; the model read the unknown text, and a replay of the charge that answered."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "claude_agent_sdk_agent.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env={"PYTHONPATH": str(root / "src"), "TMPDIR": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    assert out.returncode == 0, out.stderr
    assert "without onceonly, a lost answer: charges made: 2" in out.stdout
    assert "with onceonly, a lost answer: charges made: 1" in out.stdout
    assert "with onceonly, an answer: charges made: 1" in out.stdout
    assert out.stdout.count(UNKNOWN) == 2 and NOT_REPEATED in out.stdout
    assert "onceonly resolve" not in out.stdout  # the operator's text is the log's
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_read_only_sdk_tools_error_result_reaches_the_model_as_it_is(
    ledger: Ledger, charges: Charges, home: Path
) -> None:
    @sdk.tool(
        "charge",
        "Look a charge up.",
        {"customer": str, "cents": int},
        annotations=sdk.ToolAnnotations(readOnlyHint=True),
    )
    async def lookup(args: dict[str, Any]) -> dict[str, Any]:
        charges.add(args["customer"], args["cents"])  # counts the runs: a read runs each time
        return {"content": [{"type": "text", "text": "no such charge"}], "is_error": True}

    with FakeMessagesApi(scripted([charge_call()], [charge_call()])) as api:
        asyncio.run(session(api, home, create_sdk_mcp_server("billing", [lookup], ledger)))
    assert charges.count() == 2
    assert [(r["text"].split("\n")[0], r["is_error"]) for r in results_of(api)] == [("no such charge", True)] * 2
    assert ledger.list() == []
