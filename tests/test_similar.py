"""Near-duplicate calls (``similar=``): a reworded re-plan is the operation already asked for, on every store.

Side effects are counted in a real SQLite file (tests/_workers.py), never inferred from return values.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import onceonly
from onceonly import Ledger, OutcomeUnknown, Similar, SimilarCall, State
from onceonly.cli import cli
from tests._clock import FakeClock
from tests._workers import count_effects, effects_db

SIM = Similar(fields=("title",), threshold=0.85, window=3600)


@pytest.fixture(name="effects")
def fixture_effects(tmp_path: Path) -> Path:
    """A side-effect log: one row per real run of a tool body."""
    path = tmp_path / "effects.db"
    effects_db(path).close()
    return path


def _ticket_tool(ledger: Ledger, effects: Path, *, on_similar: Any = "replay", **kw: Any) -> Any:
    conn = effects_db(effects)

    @ledger.tool(name=kw.pop("name", "create_ticket"), key=("session_id", "title"), similar=kw.pop("similar", SIM),
                 on_similar=on_similar, **kw)  # fmt: skip
    def create_ticket(session_id: str, title: str) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (session_id, title, time.time()))
        return {"ticket": title, "session": session_id}

    return create_ticket


def _runs(effects: Path) -> int:
    return sum(count_effects(effects).values())


def test_a_reworded_replan_replays_the_first(ledger: Ledger, effects: Path) -> None:
    """'Printer on fire' re-planned as 'The printer is on fire!' in the same session: one ticket, and the
    second call is flagged as a replay of the first, which keeps both argument sets."""
    create = _ticket_tool(ledger, effects)
    first = create.outcome("s1", "Printer on fire")
    second = create.outcome("s1", "The printer is on fire!")
    assert _runs(effects) == 1
    assert (first.replayed, first.similar_to) == (False, None)
    assert second.replayed and second.similar_to == first.key
    assert second.result == first.result == {"ticket": "Printer on fire", "session": "s1"}
    assert second.similar_args == {"session_id": "s1", "title": "Printer on fire"}
    rec = ledger.get(first.key)
    assert rec is not None and rec.args["title"] == "Printer on fire"
    assert "The printer is on fire!" in rec.history[-1]["reason"]
    assert "similar call" in rec.history[-1]["reason"]
    text = onceonly.tell_model(second)
    assert "similar action was already done" in text and "Printer on fire" in text and '"ticket"' in text


def test_same_words_in_another_session_run_twice(ledger: Ledger, effects: Path) -> None:
    """The exact key fields (the session) still tell operations apart: two sessions, two tickets."""
    create = _ticket_tool(ledger, effects)
    create("s1", "Printer on fire")
    other = create.outcome("s2", "The printer is on fire!")
    assert _runs(effects) == 2 and other.similar_to is None and not other.replayed


def test_a_dissimilar_title_runs(ledger: Ledger, effects: Path) -> None:
    """Another problem in the same session is another ticket."""
    create = _ticket_tool(ledger, effects)
    create("s1", "Printer on fire")
    create("s1", "Email is down")
    create("s1", "Reset the password for alice")
    create("s1", "Reset the password for bob")
    assert _runs(effects) == 4


def test_a_short_subject_does_not_swallow_the_group(ledger: Ledger, effects: Path) -> None:
    """An earlier email with the subject 'the', then three different emails to the same customer: each
    is sent (a text without a meaningful word matches nothing, and one whose words are all inside a
    longer one's scores in proportion). A reworded one of them still replays it."""
    send = _ticket_tool(ledger, effects, name="send_email")
    assert send.outcome("ada@example.com", "the").similar_to is None
    subjects = ["The invoice for March", "The meeting moved to Friday", "The contract renewal"]
    outs = [send.outcome("ada@example.com", subject) for subject in subjects]
    assert [o.similar_to for o in outs] == [None, None, None] and not any(o.replayed for o in outs)
    assert _runs(effects) == 4
    again = send.outcome("ada@example.com", "Invoice for March!")
    assert again.replayed and again.similar_to == outs[0].key
    assert _runs(effects) == 4


def test_a_short_subject_with_a_word_of_its_own_does_not_swallow_either(ledger: Ledger, effects: Path) -> None:
    """'Invoice' covers one word of 'Invoice for March' (0.67): in either order, two emails."""
    send = _ticket_tool(ledger, effects, name="send_email")
    send("ada@example.com", "Invoice")
    assert send.outcome("ada@example.com", "Invoice for March").similar_to is None
    send("bob@example.com", "Invoice for April")
    assert send.outcome("bob@example.com", "invoice").similar_to is None
    assert _runs(effects) == 4


def test_numbers_compare_exactly(ledger: Ledger, effects: Path) -> None:
    """'refund order 1234' and 'refund order 1235' score high as text, and are two operations."""
    create = _ticket_tool(ledger, effects)
    create("s1", "refund order 1234")
    assert create.outcome("s1", "Refund order 1235").similar_to is None
    assert create.outcome("s1", "please refund order 1234!").similar_to is not None
    assert _runs(effects) == 2


def test_outside_the_window_runs_again(ledger: Ledger, clock: FakeClock, effects: Path) -> None:
    """A call after the window of the earlier one is a new operation."""
    create = _ticket_tool(ledger, effects)
    create("s1", "Printer on fire")
    clock.now += 3600.5
    assert create.outcome("s1", "The printer is on fire!").similar_to is None
    assert _runs(effects) == 2


def test_explicit_key_and_occurrence_skip_the_lookup(ledger: Ledger, effects: Path) -> None:
    """A caller that names the operation (an explicit key, a second occurrence) is taken at its word."""
    create = _ticket_tool(ledger, effects)
    create("s1", "Printer on fire")
    create.using(key="my-own-key")("s1", "The printer is on fire!")
    create.using(occurrence=2)("s1", "Printer on fire")
    assert _runs(effects) == 3


def test_review_parks_the_new_call_with_a_link(ledger: Ledger, effects: Path, store_url: str) -> None:
    """on_similar='review': the new call is not run, its record waits for a person beside the earlier
    one, and ``onceonly show`` names the earlier call."""
    create = _ticket_tool(ledger, effects, on_similar="review")
    first = create.outcome("s1", "Printer on fire")
    with pytest.raises(OutcomeUnknown) as info:
        create("s1", "The printer is on fire!")
    assert _runs(effects) == 1
    parked = info.value.record
    assert parked is not None and parked.state is State.NEEDS_REVIEW
    assert first.key in str(info.value) and "on_similar='review'" in str(info.value)
    stored = ledger.get(parked.key)
    assert stored is not None and stored.state is State.NEEDS_REVIEW
    assert any(e.get("similar_to") == first.key for e in stored.history)
    # The same call again waits for the person; it is not run and not parked twice.
    with pytest.raises(OutcomeUnknown):
        create("s1", "The printer is on fire!")
    shown = CliRunner().invoke(cli, ["show", "--url", store_url, parked.key])
    assert shown.exit_code == 0, shown.output
    assert "similar to" in shown.output and first.key in shown.output
    # A person says it is another operation: reset, and the call runs under its own key.
    ledger.resolve(parked.key, failed="a different printer", reset=True)
    assert create.outcome("s1", "The printer is on fire!").key == parked.key
    assert _runs(effects) == 2


def test_raise_carries_the_earlier_outcome(ledger: Ledger, effects: Path) -> None:
    """on_similar='raise': ``SimilarCall`` with the earlier outcome; nothing runs."""
    create = _ticket_tool(ledger, effects, on_similar="raise")
    first = create.outcome("s1", "Printer on fire")
    with pytest.raises(SimilarCall) as info:
        create("s1", "the printer is on fire")
    err = info.value
    assert err.key == first.key and err.new_key != first.key and err.score >= 0.85
    assert err.outcome is not None and err.outcome.result == first.result and err.outcome.state is State.CONFIRMED
    assert _runs(effects) == 1
    text = onceonly.tell_model(err)
    assert "similar action was already done" in text and "Printer on fire" in text


def test_a_held_similar_call_is_waited_on(store_url: str, effects: Path) -> None:
    """While the first call runs, a reworded one waits for it (single-flight) and replays its result."""
    ledger = Ledger.open(store_url)
    started, release = threading.Event(), threading.Event()
    conn = effects_db(effects)

    @ledger.tool(name="slow_ticket", key=("session_id", "title"), similar=SIM, wait=20)
    def slow_ticket(session_id: str, title: str) -> str:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (session_id, title, time.time()))
        started.set()
        release.wait(10)
        return f"ticket for {title}"

    box: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: box.setdefault("first", slow_ticket.outcome("s1", "Printer on fire")))
    runner.start()
    assert started.wait(10)
    threading.Timer(0.3, release.set).start()
    second = slow_ticket.outcome("s1", "The printer is on fire!")
    runner.join(10)
    assert _runs(effects) == 1
    assert second.replayed and second.similar_to == box["first"].key and second.result == "ticket for Printer on fire"
    ledger.close()


def _race(store_url: str, effects: Path, titles: list[str], session: str) -> list[onceonly.Outcome]:
    """Each title called at once from its own thread and its own ledger (its own connections)."""
    barrier = threading.Barrier(len(titles))
    out: list[Any] = [None] * len(titles)

    def work(i: int) -> None:
        ledger = Ledger.open(store_url)
        try:
            create = _ticket_tool(ledger, effects, wait=30)
            barrier.wait(10)
            out[i] = create.outcome(session, titles[i])
        except BaseException as exc:  # checked below
            out[i] = exc
        finally:
            ledger.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(titles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("round_", range(3))
def test_racing_similar_calls_run_once(store_url: str, effects: Path, round_: int) -> None:
    """Four reworded calls with four different keys, at once: one side effect; the others replay it."""
    titles = ["Printer on fire", "The printer is on fire!", "printer on fire!!", "Printer is on fire"]
    outs = _race(store_url, effects, titles, f"race-{round_}")
    assert not [o for o in outs if isinstance(o, BaseException)], outs
    assert _runs(effects) == 1
    ran = [o for o in outs if not o.replayed]
    assert len(ran) == 1
    assert all(o.similar_to == ran[0].key for o in outs if o is not ran[0])
    assert all(o.result == ran[0].result for o in outs)


def test_async_reworded_replan_and_race(store_url: str, effects: Path) -> None:
    """The async driver: a reworded re-plan replays, and racing reworded tasks run once."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        conn = effects_db(effects)

        @ledger.tool(name="acreate", key=("session_id", "title"), similar=SIM, wait=20)
        async def acreate(session_id: str, title: str) -> str:
            conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (session_id, title, time.time()))
            await asyncio.sleep(0.05)
            return f"ticket {title}"

        first = await acreate.outcome("s1", "Printer on fire")
        second = await acreate.outcome("s1", "The printer is on fire!")
        assert second.replayed and second.similar_to == first.key
        raced = await asyncio.gather(
            acreate.outcome("s2", "Laptop screen broken"),
            acreate.outcome("s2", "The laptop screen is broken"),
            acreate.outcome("s2", "laptop screen broken!"),
        )
        assert sum(not o.replayed for o in raced) == 1
        await ledger.store.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
    assert _runs(effects) == 2


def test_async_review_and_raise(store_url: str, effects: Path) -> None:
    """The async driver parks for review and raises ``SimilarCall`` as the sync one does."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        runs: list[str] = []

        @ledger.tool(name="areview", key=("session_id", "title"), similar=SIM, on_similar="review")
        async def areview(session_id: str, title: str) -> str:
            runs.append(title)
            return title

        @ledger.tool(name="araise", key=("session_id", "title"), similar=SIM, on_similar="raise")
        async def araise(session_id: str, title: str) -> str:
            runs.append(title)
            return title

        await areview("s1", "Printer on fire")
        with pytest.raises(OutcomeUnknown):
            await areview("s1", "The printer is on fire!")
        await araise("s1", "Printer on fire")
        with pytest.raises(SimilarCall) as info:
            await araise("s1", "The printer is on fire!")
        assert info.value.outcome.result == "Printer on fire"
        assert runs == ["Printer on fire", "Printer on fire"]
        await ledger.store.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())


def test_purge_takes_records_out_of_their_group(ledger: Ledger, clock: FakeClock, effects: Path) -> None:
    """A purged record is forgotten, as with exact keys: a later reworded call runs (ttl < window)."""
    create = _ticket_tool(ledger, effects, ttl=60)
    create("s1", "Printer on fire")
    clock.now += 61
    assert ledger.purge() == 1
    create("s1", "The printer is on fire!")
    assert _runs(effects) == 2


def test_a_plain_tool_beside_a_similar_one_is_unchanged(ledger: Ledger, effects: Path) -> None:
    """A tool without similar= keeps exact keys: a reworded call is another operation."""
    create = _ticket_tool(ledger, effects, similar=None)
    create("s1", "Printer on fire")
    assert create.outcome("s1", "The printer is on fire!").similar_to is None
    assert _runs(effects) == 2


# --- settings and the score --------------------------------------------------------------------------


def test_a_custom_score_is_used(ledger: Ledger, effects: Path) -> None:
    """``Similar(score=...)`` replaces the default score; exact tokens still hold unless switched off."""
    seen: list[tuple[str, str]] = []

    def always(a: str, b: str) -> float:
        seen.append((a, b))
        return 1.0

    create = _ticket_tool(ledger, effects, similar=Similar(fields=("title",), score=always))
    create("s1", "anything")
    assert create.outcome("s1", "something else").similar_to is not None
    assert seen == [("anything", "something else")]
    assert create.outcome("s1", "order 7").similar_to is None  # a number the earlier calls lack
    loose = _ticket_tool(ledger, effects, name="loose", similar=Similar(("title",), score=always, exact_tokens=False))
    loose("s9", "order 7")
    assert loose.outcome("s9", "order 8").similar_to is not None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Similar(fields="title"), "tuple of field names"),  # type: ignore[arg-type]
        (lambda: Similar(fields=("title",), threshold=0), "above 0 and at most 1"),
        (lambda: Similar(fields=("title",), threshold=1.5), "above 0 and at most 1"),
        (lambda: Similar(fields=("title",), window=0), "window"),
        (lambda: Similar(fields=("title",), candidates=0), "candidates"),
        (lambda: Similar(fields=("title",), score="fuzzy"), "give a function"),  # type: ignore[arg-type]
        (lambda: Similar(fields=("title",), min_words=0), "min_words"),
        (lambda: Similar(fields=("title",), stop_words="the"), "set of words"),
        (lambda: Similar(fields=("title",), stop_words={"don't"}), "not one word"),
    ],
)
def test_bad_settings_say_what_to_give(make: Callable[[], Similar], message: str) -> None:
    """Each bad setting is refused with what to give instead."""
    with pytest.raises((TypeError, ValueError), match=message):
        make()


def test_stop_words_and_min_words_can_be_set(ledger: Ledger, effects: Path) -> None:
    """``stop_words`` replaces the built-in list (case folded); ``min_words`` holds with a score of
    one's own too."""
    plain = Similar(fields=("title",))
    assert plain.field_score("the", "the") == 0.0 and plain.field_score("Printer on fire", "the printer on fire") == 1.0
    german = Similar(fields=("title",), stop_words={"Der", "ist"})
    assert german.field_score("Der Drucker brennt", "Drucker ist brennt") == 1.0
    assert german.field_score("the printer", "printer") < german.threshold  # "the" counts now
    everything = Similar(fields=("title",), stop_words=frozenset())
    assert everything.field_score("the", "The!") == 1.0
    strict = Similar(fields=("title",), min_words=2, score=lambda a, b: 1.0)
    assert strict.field_score("Refund", "refund") == 0.0 and strict.field_score("Refund it", "refund order") == 0.0
    assert strict.field_score("Refund order", "refund the order") == 1.0
    create = _ticket_tool(ledger, effects, similar=strict)
    create("s1", "Refund")
    assert create.outcome("s1", "refund!").similar_to is None
    assert _runs(effects) == 2


def test_bad_tool_settings_say_what_to_give(ledger: Ledger) -> None:
    """similar= names key fields; on_similar is one of three; a key= function cannot be split."""

    def tool(session_id: str, title: str, body: str) -> None: ...

    with pytest.raises(TypeError, match="not key fields"):
        ledger.tool(name="a", key=("session_id",), similar=SIM)(tool)
    with pytest.raises(ValueError, match="on_similar"):
        ledger.tool(name="b", similar=SIM, on_similar="merge")(tool)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key= is a function"):
        ledger.tool(name="c", key=lambda a: a["title"], similar=SIM)(tool)
    with pytest.raises(TypeError, match=r"onceonly\.Similar"):
        ledger.tool(name="d", similar=("title",))(tool)  # type: ignore[arg-type]


def test_a_failing_score_frees_the_group(ledger: Ledger, effects: Path) -> None:
    """A score function that raises ends the call with its error and leaves the group usable."""
    calls = {"n": 0}

    def flaky(a: str, b: str) -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("model down")
        return 0.0

    create = _ticket_tool(ledger, effects, similar=Similar(fields=("title",), score=flaky), wait=0.5)
    create("s1", "first")
    with pytest.raises(RuntimeError, match="model down"):
        create("s1", "second")
    create("s1", "second")  # the lock was freed: no wait, no InProgress
    assert _runs(effects) == 2


def test_missing_rapidfuzz_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rapidfuzz and without score=, Similar() says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "rapidfuzz", None)
    with pytest.raises(ImportError, match=r"onceonly\[similar\]"):
        Similar(fields=("title",))
    Similar(fields=("title",), score=lambda a, b: 0.5)  # a score of one's own needs no rapidfuzz


def _group_entries(ledger: Ledger) -> int:
    """How many group entries the store holds (read below the store's API, to see what purge left)."""
    store: Any = ledger.store
    url = ledger.store.url
    if url.startswith("sqlite"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(store.path)) as conn:
            return int(conn.execute("SELECT count(*) FROM onceonly_similar").fetchone()[0])
    if url.startswith("postgres"):
        import psycopg

        with psycopg.connect(store.options.conninfo) as conn:
            row = conn.execute(f'SELECT count(*) FROM "{store.schema}".onceonly_similar').fetchone()
            return int(row[0]) if row else 0
    import redis

    client = redis.Redis.from_url(url.split("?")[0])
    try:
        return sum(int(client.zcard(k)) for k in client.scan_iter(match=f"{store.prefix}:*:gs:*"))
    finally:
        client.close()


def test_purge_removes_group_entries(ledger: Ledger, clock: FakeClock, effects: Path) -> None:
    """SQL stores drop a purged record's group entry with it; Redis trims entries older than the window
    at the group's next lookup (and a group's keys expire a window after its last claim)."""
    create = _ticket_tool(ledger, effects, ttl=60, similar=Similar(fields=("title",), window=120))
    create("s1", "Printer on fire")
    assert _group_entries(ledger) == 1
    clock.now += 121
    assert ledger.purge() == 1
    if ledger.store.url.startswith("redis"):
        create("s1", "Email is down")  # the lookup trims what is older than the window, then files its own
    assert _group_entries(ledger) == (1 if ledger.store.url.startswith("redis") else 0)


@pytest.mark.parametrize("lost", ["before", "after"])
def test_a_claim_whose_answer_is_lost_runs_once(ledger: Ledger, effects: Path, lost: str) -> None:
    """The store fails on the similar claim, before writing anything or after writing it (the answer
    lost): the call reads the record, runs the tool once, and the claim is filed in its group, so a
    reworded call afterwards replays it."""
    store: Any = ledger.store
    real = store.similar_claim
    failures = {"left": 1}

    def lossy(record: Any, group: str, token: str) -> Any:
        if failures["left"] and lost == "before":
            failures["left"] -= 1
            raise onceonly.StoreUnavailable("the store went away before the claim")
        got = real(record, group, token)
        if failures["left"]:
            failures["left"] -= 1
            raise onceonly.StoreUnavailable("the answer of the claim was lost")
        return got

    store.similar_claim = lossy
    create = _ticket_tool(ledger, effects, wait=5)
    first = create.outcome("s1", "Printer on fire")
    assert not first.replayed and failures["left"] == 0
    again = create.outcome("s1", "The printer is on fire!")
    assert again.similar_to == first.key and _runs(effects) == 1
    other = create.outcome("s1", "Email is down")  # the group's lock was freed: no wait, no InProgress
    assert not other.replayed and _runs(effects) == 2


def race_process(store_url: str, effects: str, title: str, barrier: Any) -> dict[str, Any]:
    """One racing process: its own ledger, one reworded call at the barrier (spawned by the test below)."""
    ledger = Ledger.open(store_url)
    try:
        create = _ticket_tool(ledger, Path(effects), wait=60)
        barrier.wait(60)
        out = create.outcome("procs", title)
        return {"key": out.key, "replayed": out.replayed, "similar_to": out.similar_to}
    finally:
        ledger.close()


@pytest.mark.slow
def test_racing_similar_calls_from_processes_run_once(store_url: str, effects: Path) -> None:
    """Four processes, four rewordings, one barrier: one side effect; every other call names its key."""
    import multiprocessing

    titles = ["Printer on fire", "The printer is on fire!", "printer on fire!!", "Printer is on fire"]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(len(titles))
        with ctx.Pool(len(titles)) as pool:
            outs = pool.starmap(race_process, [(store_url, str(effects), t, barrier) for t in titles], chunksize=1)
    assert _runs(effects) == 1
    ran = [o for o in outs if not o["replayed"]]
    assert len(ran) == 1 and all(o["similar_to"] == ran[0]["key"] for o in outs if o is not ran[0])


def test_a_lookup_that_keeps_losing_its_lock_gives_up(ledger: Ledger, clock: FakeClock, effects: Path) -> None:
    """A lookup slower than the group lock, during which another call takes the lock and claims in the
    group each time: the call renews the lock, sees the group changed, looks again, and after a few tries
    ends, having run nothing, and says what to change."""
    from onceonly import states as st

    if ledger.store.url.startswith("redis"):
        pytest.skip("a Redis lock runs out on the server's clock, which the test's fake clock cannot age")
    store: Any = ledger.store
    made = {"n": 0}

    def slow(a: str, b: str) -> float:
        clock.now += 11  # longer than the lock holds
        made["n"] += 1
        assert store.similar_lock(group, "another call", clock.now, clock.now + 10, 0.0, 1) is not None
        other = st.new_record(
            key=f"{group}-other-{made['n']}", scope="default", tool="create_ticket", fingerprint="f",
            args_json='{"session_id":"s1","title":"other"}', state=st.State.IN_FLIGHT, owner="another call",
            now=clock.now, lease_seconds=30,
        )  # fmt: skip
        assert store.similar_claim(other, group, "another call") is None
        return 0.0

    create = _ticket_tool(ledger, effects, similar=Similar(fields=("title",), score=slow))
    group = create.spec.call(("s1", "Email is down"), {}, None, 1).similar.group
    create("s1", "Printer on fire")
    with pytest.raises(onceonly.OnceOnlyError, match="lost its group lock 3 times"):
        create("s1", "Email is down")
    assert _runs(effects) == 1
    assert ledger.get(create.key_for("s1", "Email is down")) is None
