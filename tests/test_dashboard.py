"""The dashboard's JSON API on every store, through Starlette's TestClient and a real uvicorn server:
counts, filters and paging, a record's timeline, per-tool latency, resolving a record in review (the
store changes, with who and why in its history), the token and the Host and Origin checks, and reads
that leave the store exactly as it was. ``onceonly dashboard`` itself runs in a process of its own."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from onceonly import Ledger, State, ops
from onceonly import states as st
from onceonly.cli import cli
from onceonly.dashboard.app import check_binding, create_app, is_loopback
from onceonly.tickets import serve_in_thread
from tests._dashboard import Events, Seeded, running, seed, timed_charge
from tests._redis_server import PrivateRedis
from tests._urls import SECRET, with_password

TOKEN = "t0ken-for-the-dashboard-tests"
EVERY_GET = ["/", "/api/counts", "/api/records", "/api/stats", "/api/pauses", "/api/events"]


@pytest.fixture(name="seeded")
def fixture_seeded(store_url: str) -> Seeded:
    """The store's ledger, filled by ``seed``."""
    return seed(store_url)


@pytest.fixture(name="api", params=["testclient", "uvicorn"])
def fixture_api(request: pytest.FixtureRequest, store_url: str, seeded: Seeded) -> Iterator[httpx.Client]:
    """A client of the dashboard over the seeded ledger: Starlette's TestClient, or httpx against the
    app served by uvicorn on a free port of 127.0.0.1."""
    with Ledger.open(store_url) as ledger:
        app = create_app(ledger, poll_seconds=0.05)
        if request.param == "testclient":
            with TestClient(app, base_url="http://127.0.0.1:8765") as client:
                yield client
            return
        with serve_in_thread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            yield client


def _ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def _everything(url: str) -> dict[str, Any]:
    with Ledger.open(url) as ledger:
        return {r.key: r for r in ledger.list(limit=1000)}


def test_counts_filters_paging_and_timeline(api: httpx.Client, store_url: str, seeded: Seeded) -> None:
    """The counts are the store's; filters by state, tool, scope, key prefix and time narrow the page;
    ``after`` pages in key order; a short key opens the record with its whole timeline."""
    counts = _ok(api.get("/api/counts"))
    assert counts["states"]["confirmed"] == len(seeded.confirmed) == 21
    assert (counts["states"]["needs_review"], counts["states"]["failed"], counts["states"]["unknown"]) == (2, 1, 1)
    assert counts["total"] == 25

    review = _ok(api.get("/api/records", params={"state": "needs_review"}))
    assert [r["key"] for r in review["records"]] == sorted(seeded.review)
    assert review["more"] == 0 and review["next_after"] is None
    both = _ok(api.get("/api/records", params=[("state", "failed"), ("state", "unknown")]))
    assert {r["key"] for r in both["records"]} == {seeded.failed, seeded.unknown}
    assert [r["tool"] for r in _ok(api.get("/api/records", params={"tool": "email"}))["records"]] == ["email"]
    assert _ok(api.get("/api/records", params={"scope": "elsewhere"}))["records"] == []
    recent = _ok(api.get("/api/records", params={"tool": "charge", "since": "30m"}))
    assert len(recent["records"]) == 3  # the charges made now, not those of hours ago
    hour = _ok(api.get("/api/records", params={"prefix": "default:charge:h01"}))
    assert [r["key"] for r in hour["records"]] == [f"default:charge:h01n{n}" for n in range(3)]
    hours = {"prefix": "default:charge:h0", "limit": 10}
    early = _ok(api.get("/api/records", params=hours))
    late = _ok(api.get("/api/records", params={**hours, "after": early["next_after"]}))
    assert (len(early["records"]), early["more"], len(late["records"]), late["more"]) == (10, 8, 8, 0)
    assert all(r["key"].startswith("default:charge:h0") for r in early["records"] + late["records"])
    exact = _ok(api.get("/api/records", params={"prefix": seeded.failed, "state": "failed"}))
    assert [r["key"] for r in exact["records"]] == [seeded.failed]
    assert _ok(api.get("/api/records", params={"prefix": seeded.failed, "state": "confirmed"}))["records"] == []

    first = _ok(api.get("/api/records", params={"tool": "charge", "limit": 10}))
    assert len(first["records"]) == 10 and first["more"] == 11
    second = _ok(api.get("/api/records", params={"tool": "charge", "limit": 10, "after": first["next_after"]}))
    keys = [r["key"] for r in first["records"] + second["records"]]
    assert keys == sorted(keys) and len(set(keys)) == 20 and second["more"] == 1
    assert all(first["short"][k].startswith("default:charge:") for k in keys[:10])

    short = review["short"][seeded.review[0]]
    assert len(short) < len(seeded.review[0])
    rec = _ok(api.get("/api/record", params={"key": short}))
    assert rec["key"] == seeded.review[0] and rec["state"] == "needs_review" and rec["args"] == {"order": "o-1"}
    assert rec["error"] == "TimeoutError: read timed out" and rec["conflicts"] == 0
    steps = [(h["from"], h["to"]) for h in rec["history"]]
    assert steps == [(None, "in_flight"), ("in_flight", "unknown"), ("unknown", "needs_review")]
    assert all(h["at_iso"].endswith("Z") and h["at_iso"].startswith("20") for h in rec["history"])
    with Ledger.open(store_url) as ledger:
        assert rec == {**ops.record_json(ops.find(ledger, short)), "short": short}  # what `show --json` says


def test_bad_queries_are_answered_with_what_to_give(api: httpx.Client) -> None:
    """A bad filter is a 400 naming it; an unknown key a 404, an ambiguous prefix a 409."""
    for params, words in (
        ({"state": "done"}, "give one of pending"),
        ({"since": "yesterday"}, "neither a duration"),
        ({"limit": "0"}, "limit='0': give a number from 1 to 500"),
    ):
        answer = api.get("/api/records", params=params)
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text
    assert api.get("/api/record", params={"key": "nothing-like-it"}).status_code == 404
    ambiguous = api.get("/api/record", params={"key": "default:charge:"})
    assert ambiguous.status_code == 409 and "give more of the key" in ambiguous.json()["error"]


def test_latency_by_tool(api: httpx.Client) -> None:
    """``/api/stats`` is ``onceonly stats --json`` plus each tool's p50/p99 per time bucket: the
    charges of six past hours fall in six buckets besides the current one."""
    stats = _ok(api.get("/api/stats"))
    charge = next(t for t in stats["tools"] if t["tool"] == "charge")
    assert charge["attempts_timed"] == 21 and charge["p99"] >= charge["p50"] > 0
    latency = stats["latency"]
    assert latency["bucket_seconds"] == 900  # about six hours: 15 minutes gives at most 48 buckets
    series = latency["tools"]["charge"]
    assert len(series) >= 7 and sum(p["count"] for p in series) == 21
    oldest = series[0]  # h05: durations 0.1, 0.15, 0.2
    assert (oldest["count"], oldest["p50"], oldest["p99"]) == (3, pytest.approx(0.15), pytest.approx(0.2))
    assert [p["start"] for p in series] == sorted(p["start"] for p in series)
    hourly = _ok(api.get("/api/stats", params={"bucket": "3600"}))["latency"]
    assert hourly["bucket_seconds"] == 3600 and all(p["start"] % 3600 == 0 for p in hourly["tools"]["charge"])


@pytest.mark.parametrize("outcome", ["failed", "confirmed"])
def test_resolve_with_reason_and_who(api: httpx.Client, store_url: str, seeded: Seeded, outcome: str) -> None:
    """Resolving a record in review writes to the store: its state, ``via="resolve"``, and a history
    entry naming who and why. A record not in review, a stale version, or no name or reason is refused
    and changes nothing."""
    key = seeded.review[0]
    with Ledger.open(store_url) as ledger:
        version = ledger.get(key).version  # type: ignore[union-attr]
    body: dict[str, Any] = {"key": key, "version": version, "by": "alice", "why": "the bank shows no refund"}
    body.update({"failed": "the bank shows no refund"} if outcome == "failed" else {"confirmed": {"refund": "r-9"}})

    before = _everything(store_url)
    for bad, status, words in (
        ({**body, "by": " "}, 400, "give who resolves it and why"),
        ({k: v for k, v in body.items() if k != "why"}, 400, "give who resolves it and why"),
        ({**body, "version": version - 1}, 409, "changed since the page read it"),
        ({**body, "key": seeded.failed}, 409, "is failed, not needs_review"),
        ({**body, "key": "default:refund:nope"}, 404, "no record"),
        ({**body, "failed": "x", "confirmed": 1}, 400, "exactly one of"),
    ):
        answer = api.post("/api/resolve", json=bad)
        assert answer.status_code == status and words in answer.json()["error"], (bad, answer.text)
    assert _everything(store_url) == before

    done = _ok(api.post("/api/resolve", json=body))
    assert done["state"] == outcome and done["via"] == "resolve"
    with Ledger.open(store_url) as ledger:
        rec = ledger.get(key)
    assert rec is not None and rec.state is State(outcome) and rec.version > version
    last = rec.history[-1]
    assert (last["from"], last["to"], last["by"]) == ("needs_review", outcome, "alice")
    assert last["reason"] == "resolved by alice: the bank shows no refund"
    if outcome == "confirmed":
        assert rec.result == {"refund": "r-9"}
    else:
        assert rec.error == "the bank shows no refund"
    again = api.post("/api/resolve", json={**body, "version": rec.version})
    assert again.status_code == 409 and "not needs_review" in again.json()["error"]
    assert _ok(api.get("/api/counts"))["states"]["needs_review"] == 1


def _sqlite_files(url: str) -> dict[str, bytes]:
    """A SQLite ledger's file and its write-ahead log, byte for byte (nothing for the other stores).
    Not the -shm index, where readers mark what they read."""
    if not url.startswith("sqlite:"):
        return {}
    path = Path(url.removeprefix("sqlite:///"))
    found = {p.name: p.read_bytes() for p in (path, path.with_name(f"{path.name}-wal")) if p.exists()}
    assert path.name in found
    return found


def test_reads_leave_the_store_as_it_was(api: httpx.Client, store_url: str, seeded: Seeded) -> None:
    """Every read endpoint, with and without filters, leaves each record (state, version, history)
    exactly as it was; a SQLite ledger's files are not written at all."""
    before, files = _everything(store_url), _sqlite_files(store_url)
    assert api.get("/").status_code == 200
    for path in EVERY_GET[1:-1]:
        _ok(api.get(path))
    for params in ({"state": "needs_review"}, {"tool": "charge", "prefix": "default:charge:h0", "since": "1d"}):
        _ok(api.get("/api/records", params=params))
    for key in (seeded.review[0], seeded.unknown, seeded.confirmed[-1]):
        _ok(api.get("/api/record", params={"key": key}))
    if not isinstance(api, TestClient):  # TestClient reads whole answers, and the stream never ends
        with api.stream("GET", "/api/events") as response:
            assert Events(response).next()[0] == "counts"
    assert _sqlite_files(store_url) == files
    assert _everything(store_url) == before


# --- who may call it --------------------------------------------------------------------------------


@pytest.fixture(name="guarded")
def fixture_guarded(sqlite_url: str) -> Iterator[TestClient]:
    """A TestClient of a dashboard that needs ``TOKEN``, over a seeded SQLite ledger."""
    seed(sqlite_url, orders=1, reviews=1, spread_hours=0)
    with Ledger.open(sqlite_url) as ledger, TestClient(create_app(ledger, token=TOKEN)) as client:
        yield client


def test_a_token_is_needed_for_every_request(guarded: TestClient) -> None:
    """With a token set, the page and every API answer 401 without it or with another; with it, in
    the header or (for a GET) in the address, they answer. The stream is refused before it starts."""
    for path in EVERY_GET:
        missing = guarded.get(path)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer", path
        assert guarded.get(path, headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
        assert guarded.get(path, params={"token": TOKEN[:-1]}).status_code == 401
    for path in EVERY_GET[:-1]:
        assert guarded.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
        assert guarded.get(path, params={"token": TOKEN}).status_code == 200, path
    page = guarded.get("/", params={"token": TOKEN})
    assert TOKEN not in page.text and page.headers["referrer-policy"] == "no-referrer"
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY"


def test_a_write_takes_the_token_in_its_header_json_and_the_same_origin(guarded: TestClient, sqlite_url: str) -> None:
    """``POST /api/resolve`` refuses the token in the address (a link or a form could carry it),
    a body that is not JSON by its content type, and a request from another origin."""
    (rec,) = Ledger.open(sqlite_url).list(state="needs_review")
    body = {"key": rec.key, "failed": "no refund", "by": "alice", "why": "no refund"}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert guarded.post("/api/resolve", params={"token": TOKEN}, json=body).status_code == 401
    as_form = guarded.post("/api/resolve", headers=auth, content=json.dumps(body), params={})
    assert as_form.status_code == 415  # no Content-Type: application/json
    other = guarded.post("/api/resolve", headers={**auth, "Origin": "https://evil.example"}, json=body)
    assert other.status_code == 403 and "Origin" in other.json()["error"]
    assert Ledger.open(sqlite_url).get(rec.key).state is State.NEEDS_REVIEW  # type: ignore[union-attr]
    same = guarded.post("/api/resolve", headers={**auth, "Origin": "http://testserver"}, json=body)
    assert same.status_code == 200 and same.json()["state"] == "failed"


def test_without_a_token_only_a_loopback_host_is_answered(sqlite_url: str) -> None:
    """With no token, a request whose Host is not a loopback name (a DNS name rebound to 127.0.0.1)
    is refused; 127.0.0.1, localhost and [::1] are answered."""
    seed(sqlite_url, orders=1, reviews=0, spread_hours=0)
    with Ledger.open(sqlite_url) as ledger, TestClient(create_app(ledger)) as client:
        for host in ("evil.example", "evil.example:8765", "192.168.1.5:8765"):
            assert client.get("/api/counts", headers={"Host": host}).status_code == 403, host
        for host in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "127.0.0.1"):
            assert client.get("/api/counts", headers={"Host": host}).status_code == 200, host


def test_binding_beyond_loopback_needs_a_token() -> None:
    """``check_binding`` refuses a non-loopback address without a token, and a short token."""
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_binding(host, None)
    for host in ("0.0.0.0", "::", "192.168.1.5", "dashboard.example"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match="reachable from other machines: give a token"):
            check_binding(host, None)
        check_binding(host, TOKEN)
    with pytest.raises(ValueError, match="give at least 16"):
        check_binding("0.0.0.0", "short")


def test_the_command_refuses_to_serve_beyond_loopback_without_a_token(sqlite_url: str, tmp_path: Path) -> None:
    """``onceonly dashboard --host 0.0.0.0`` without a token exits 2 with what to do, before opening
    anything; a missing ledger is refused (exit 1) and not made."""
    seed(sqlite_url, orders=1, reviews=0, spread_hours=0)
    no_token = {"ONCEONLY_DASHBOARD_TOKEN": None}
    refused = CliRunner().invoke(cli, ["dashboard", "--url", sqlite_url, "--host", "0.0.0.0"], env=no_token)
    assert refused.exit_code == 2 and "give a token (--token or $ONCEONLY_DASHBOARD_TOKEN)" in refused.output
    missing = tmp_path / "nowhere" / "ledger.db"
    absent = CliRunner().invoke(cli, ["dashboard", "--url", f"sqlite:///{missing}", "--port", "0"])
    assert absent.exit_code == 1 and "no ledger at" in absent.output
    assert not missing.parent.exists()


def test_the_command_serves_with_a_token_and_streams_changes(sqlite_url: str) -> None:
    """``onceonly dashboard`` in its own process: 401 without the token, 200 with it; the token is not
    in its output; the event stream sends the counts, then new counts when a call adds a record."""
    seed(sqlite_url, orders=1, reviews=1, spread_hours=0)
    with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
        assert TOKEN not in dashboard.banner and "?token=<token>" in dashboard.banner
        assert httpx.get(f"{dashboard.url}/api/counts").status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{dashboard.url}/api/counts", headers=auth).json()["total"] == 4
        with httpx.stream("GET", f"{dashboard.url}/api/events", params={"token": TOKEN}, timeout=30) as response:
            events = Events(response)
            assert events.next() == ("counts", httpx.get(f"{dashboard.url}/api/counts", headers=auth).json())
            with Ledger.open(sqlite_url) as ledger:

                @ledger.tool(name="charge")
                def charge(order: str, amount: int) -> None:
                    return None

                charge("o-new", 1)
            began = time.monotonic()
            name, counts = events.next()
            assert name == "counts" and counts["total"] == 5 and time.monotonic() - began < 5


def test_a_missing_extra_names_the_install_command(sqlite_url: str, tmp_path: Path) -> None:
    """Without Starlette or uvicorn, ``onceonly dashboard`` exits 1 naming the extra and how to add it
    from the repository."""
    for module in ("starlette", "uvicorn"):
        code = f"import sys; sys.modules[{module!r}] = None; from onceonly.cli import main; main()"
        done = subprocess.run(
            [sys.executable, "-c", code, "dashboard", "--url", sqlite_url],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        assert "needs its extra: pip install 'onceonly[dashboard] @ git+" in done.stderr
        assert f"no module named '{module}" in done.stderr


def test_the_store_password_is_never_shown(store_url: str) -> None:
    """A Redis or PostgreSQL URL with a password: the command's first line and every answer name the
    store with the password masked."""
    if store_url.startswith("sqlite"):
        pytest.skip("a SQLite URL has no password")
    url = with_password(store_url)
    seed(url, orders=1, reviews=1, spread_hours=0)
    with running(url) as dashboard:
        assert SECRET not in dashboard.banner and urlsplit(store_url).hostname in dashboard.banner
        for path in EVERY_GET[:-1]:
            answer = httpx.get(f"{dashboard.url}{path}", timeout=30)
            assert answer.status_code == 200 and SECRET not in answer.text, path
        assert "***" in httpx.get(f"{dashboard.url}/api/counts", timeout=30).json()["url"]


def test_a_slow_count_is_read_less_often(sqlite_url: str) -> None:
    """Counting reads every record on SQLite and PostgreSQL: an open page must not keep a core busy
    on a big ledger. A count is read again no sooner than ten times as long as the last one took."""
    from onceonly.dashboard.app import COUNT_SPACING, _SharedCounts

    with Ledger.open(sqlite_url) as ledger:
        ledger.tool(name="t")(lambda n: n)(1)
        store = ledger.store
        real = store.count_by_state
        reads: list[float] = []

        def slow_count() -> Any:  # the real count, made to take as long as 100 k records would
            reads.append(time.monotonic())
            time.sleep(0.05)
            return real()

        store.count_by_state = slow_count  # type: ignore[method-assign]
        counts = _SharedCounts(ledger, every=0.01)
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            assert counts.read()["states"]["confirmed"] == 1
            time.sleep(0.01)
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    assert 2 <= len(reads) <= 4 and all(g >= COUNT_SPACING * 0.05 for g in gaps), gaps


# --- what needs a person: search, sorted views, conflicts, bulk resolve, reconcile ------------------


def _keys(answer: httpx.Response) -> list[str]:
    return [r["key"] for r in _ok(answer)["records"]]


def _with_conflicts(url: str) -> str:
    """A confirmed charge whose side effect happened twice (two conflicts counted on it); its key."""
    rec = dataclasses.replace(timed_charge("default:charge:twice", time.time() - 60, 0.1), conflicts=2)
    with Ledger.open(url) as ledger:
        assert ledger.store.insert(rec)
    return rec.key


def test_search_by_an_argument_value_and_the_views_of_what_needs_a_person(
    api: httpx.Client, store_url: str, seeded: Seeded
) -> None:
    """``arg=`` finds the records whose arguments hold a value (the order id a customer quotes), by any
    field or by name; needs_review and unknown sorted by age list the oldest first; ``sort=state``
    puts them before the rest; ``conflicts=1`` keeps the records with conflicts; sorted pages follow
    ``next_offset`` and cover every record once."""
    refund, ship = seeded.review[0], seeded.unknown
    charge = seeded.confirmed[0]
    assert set(_keys(api.get("/api/records", params={"arg": "o-1"}))) == {charge, refund, ship}
    assert set(_keys(api.get("/api/records", params={"arg": "order=o-1"}))) == {charge, refund, ship}
    assert _keys(api.get("/api/records", params=[("arg", "o-1"), ("arg", "amount=1")])) == [charge]
    assert _keys(api.get("/api/records", params={"arg": "1"})) == [charge]  # amount=1, a number
    assert _keys(api.get("/api/records", params={"arg": "to=nobody@example.com"})) == [seeded.failed]
    for nothing in ("o-9", "order=o-", "amount=o-1", "o"):
        assert _keys(api.get("/api/records", params={"arg": nothing})) == [], nothing

    person = [("state", "needs_review"), ("state", "unknown")]
    oldest = _keys(api.get("/api/records", params=[*person, ("sort", "age")]))
    assert oldest == [*seeded.review, ship]  # made in this order
    assert _keys(api.get("/api/records", params=[*person, ("sort", "-age")])) == oldest[::-1]
    by_state = _ok(api.get("/api/records", params={"sort": "state", "limit": 5}))
    states = [r["state"] for r in by_state["records"]]
    assert states == ["needs_review", "needs_review", "unknown", "failed", "confirmed"]
    assert by_state["more"] == 20 and by_state["next_offset"] == 5 and by_state["next_after"] is None

    seen: list[dict[str, Any]] = []
    params: dict[str, Any] = {"sort": "age", "limit": 10}
    while True:
        page = _ok(api.get("/api/records", params=params))
        seen += page["records"]
        if page["next_offset"] is None:
            break
        params["offset"] = page["next_offset"]
    assert len(seen) == 25 and len({r["key"] for r in seen}) == 25
    assert [r["created_at"] for r in seen] == sorted(r["created_at"] for r in seen)
    assert seen[0]["key"] == "default:charge:h05n0"  # the oldest charge, six hours ago

    assert _keys(api.get("/api/records", params={"conflicts": "1"})) == []
    twice = _with_conflicts(store_url)
    conflicted = _ok(api.get("/api/records", params={"conflicts": "1", "sort": "age"}))
    assert [(r["key"], r["conflicts"]) for r in conflicted["records"]] == [(twice, 2)]
    for bad, words in (
        ({"sort": "size"}, "sort='size': give one of key, age, -age, state"),
        ({"sort": "age", "after": "default:"}, "page with offset="),
        ({"conflicts": "maybe"}, "conflicts='maybe': give 1 or 0"),
        ({"offset": "-1"}, "offset='-1': give a number from 0"),
    ):
        answer = api.get("/api/records", params=bad)
        assert answer.status_code == 400 and words in answer.json()["error"], answer.text


def test_resolve_many_resolves_each_record_still_in_review(api: httpx.Client, store_url: str, seeded: Seeded) -> None:
    """``POST /api/resolve-many`` resolves every picked record still in review at the version the page
    read, each with who and why in its history, and refuses the others one by one (not in review, changed,
    no such key). A bad body is refused whole, before anything is written."""
    first, second = seeded.review
    with Ledger.open(store_url) as ledger:
        versions = {k: ledger.get(k).version for k in (first, second, seeded.failed)}  # type: ignore[union-attr]
    why = "the bank shows no refund"
    body: dict[str, Any] = {"failed": why, "by": "alice", "why": why}

    before = _everything(store_url)
    for bad, words in (
        ({**body, "records": []}, '"records": give the records to resolve'),
        ({**body, "records": [first]}, 'each item is {"key": K, "version": V}'),
        ({**body, "records": [{"key": first}], "by": ""}, "give who resolves it and why"),
        ({**body, "records": [{"key": first}, {"key": second, "version": "1"}]}, '"version"'),
        ({**body, "records": [{"key": first}] * 501}, "at most 500"),
    ):
        answer = api.post("/api/resolve-many", json=bad)
        assert answer.status_code == 400 and words in answer.json()["error"], (bad, answer.text)
    assert _everything(store_url) == before

    picked = [
        {"key": first, "version": versions[first]},
        {"key": second, "version": versions[second] - 1},  # the page read an older version
        {"key": seeded.failed, "version": versions[seeded.failed]},
        {"key": "default:refund:nope"},
    ]
    done = _ok(api.post("/api/resolve-many", json={**body, "records": picked}))
    assert done["count"] == {"resolved": 1, "refused": 3}
    assert [r["key"] for r in done["resolved"]] == [first] and done["resolved"][0]["state"] == "failed"
    refused = {r["key"]: (r["status"], r["error"]) for r in done["refused"]}
    assert refused[second][0] == 409 and "changed since the page read it" in refused[second][1]
    assert refused[seeded.failed][0] == 409 and "not needs_review" in refused[seeded.failed][1]
    assert refused["default:refund:nope"][0] == 404

    again = _ok(api.post("/api/resolve-many", json={**body, "records": [{"key": second}], "reset": True}))
    assert again["count"] == {"resolved": 1, "refused": 0}
    with Ledger.open(store_url) as ledger:
        for key in (first, second):
            rec = ledger.get(key)
            assert rec is not None and rec.state is State.FAILED and rec.via == "resolve"
            assert rec.history[-1]["reason"] == f"resolved by alice: {why}" and rec.history[-1]["by"] == "alice"
        assert ledger.get(second).attempts == 0  # type: ignore[union-attr]
        assert ledger.get(seeded.failed) == before[seeded.failed]
    assert _ok(api.get("/api/counts"))["states"]["needs_review"] == 0


def _expired_pending(url: str) -> str:
    """A charge whose holder died before dispatch: pending, its lease run out a minute ago."""
    now = time.time()
    rec = st.new_record(
        key="default:charge:dead", scope="default", tool="charge", fingerprint="f" * 64,
        args_json=json.dumps({"order": "o-dead", "amount": 1}), state=State.PENDING, owner="worker-dead",
        now=now - 120, lease_seconds=60,
    )  # fmt: skip
    with Ledger.open(url) as ledger:
        assert ledger.store.insert(rec)
    return rec.key


def test_reconcile_runs_the_reconciler_once_with_who_started_it(store_url: str, seeded: Seeded) -> None:
    """``POST /api/reconcile`` runs the reconciler once, as ``onceonly reconcile --once``: a record
    whose holder died before dispatch is failed, with who started it in its history. Without the app's
    tools the unknown shipment is left for them (and the answer says so); with them (``tools=``) its
    probe settles it. Who is required."""
    dead = _expired_pending(store_url)
    with Ledger.open(store_url) as ledger, TestClient(create_app(ledger), base_url="http://127.0.0.1") as client:
        missing = client.post("/api/reconcile", json={})
        assert missing.status_code == 400 and '"by": give who runs the reconciler' in missing.json()["error"]
        report = _ok(client.post("/api/reconcile", json={"by": "alice"}))
    lines = {r["key"]: r for r in report["records"]}
    assert (lines[dead]["before"], lines[dead]["after"], lines[dead]["settlement"]) == ("pending", "failed", "failed")
    assert lines[seeded.unknown]["settlement"] == "no_tool" and "no tools registered" in report["note"]
    assert report["by"] == "reconcile@dashboard:alice" and report["tools"] == []
    with Ledger.open(store_url) as ledger:
        rec = ledger.get(dead)
        assert rec is not None and rec.state is State.FAILED
        assert rec.history[-1]["by"] == "reconcile@dashboard:alice"
        assert ledger.get(seeded.unknown).state is State.UNKNOWN  # type: ignore[union-attr]

    with Ledger.open(store_url) as app, Ledger.open(store_url) as ledger:

        @app.tool(name="ship", on_unknown="probe", probe=lambda args, key: {"shipped": args["order"]})
        def ship(order: str) -> None:
            raise AssertionError("the reconciler probes; it never ships again")

        with TestClient(create_app(ledger, tools=app.tools), base_url="http://127.0.0.1") as client:
            report = _ok(client.post("/api/reconcile", json={"by": "bob"}))
    (line,) = [r for r in report["records"] if r["key"] == seeded.unknown]
    assert (line["after"], line["settlement"]) == ("confirmed", "confirmed") and "note" not in report
    with Ledger.open(store_url) as ledger:
        rec = ledger.get(seeded.unknown)
        assert rec is not None and rec.state is State.CONFIRMED and rec.result == {"shipped": "o-1"}


@pytest.mark.parametrize("path", ["/api/resolve", "/api/resolve-many", "/api/reconcile", "/api/pause", "/api/resume"])
def test_every_write_takes_the_token_in_its_header_json_and_the_same_origin(
    guarded: TestClient, sqlite_url: str, path: str
) -> None:
    """Bulk resolve and reconcile are guarded as resolve is: no token in the address, JSON only, no
    other Origin, and nothing written when refused."""
    (rec,) = Ledger.open(sqlite_url).list(state="needs_review")
    body = {"key": rec.key, "records": [{"key": rec.key}], "failed": "no refund", "by": "alice", "why": "no refund"}
    body["reason"] = "provider incident"  # what a pause takes besides "by"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = _everything(sqlite_url)
    assert guarded.post(path, params={"token": TOKEN}, json=body).status_code == 401
    assert guarded.post(path, json=body).status_code == 401
    assert guarded.post(path, headers=auth, content=json.dumps(body)).status_code == 415
    other = guarded.post(path, headers={**auth, "Origin": "https://evil.example"}, json=body)
    assert other.status_code == 403 and "Origin" in other.json()["error"]
    assert _everything(sqlite_url) == before
    with Ledger.open(sqlite_url) as ledger:
        assert ledger.pauses() == []
    same = guarded.post(path, headers={**auth, "Origin": "http://testserver"}, json=body)
    assert same.status_code == 200, same.text


def test_pause_and_resume_through_the_api(api: httpx.Client, store_url: str, seeded: Seeded) -> None:
    """``POST /api/pause`` pauses a tool for every ledger on the store (a call elsewhere is refused and
    records nothing), ``GET /api/pauses`` lists it with the command that lifts it, a body without who or
    why is refused, and ``POST /api/resume`` lifts it."""
    import onceonly

    assert _ok(api.get("/api/pauses")) == {"pauses": []}
    refused = api.post("/api/pause", json={"tool": "charge", "reason": "incident"})
    assert refused.status_code == 400 and '"by"' in refused.json()["error"]
    assert api.post("/api/pause", json=["charge"]).status_code == 400
    done = _ok(api.post("/api/pause", json={"tool": "charge", "scope": "", "reason": "incident 7", "by": "alice"}))
    (shown,) = done["pauses"]
    assert (shown["tool"], shown["scope"], shown["reason"], shown["by"]) == ("charge", None, "incident 7", "alice")
    assert shown["resume"] == "onceonly resume --tool charge" and shown["what"] == "tool 'charge' in every scope"
    assert _ok(api.get("/api/pauses"))["pauses"] == done["pauses"]
    with Ledger.open(store_url) as other:
        charge = other.tool(name="charge")(lambda order, amount: {"charged": order})
        with pytest.raises(onceonly.Paused):
            charge("o-new", 1)
        assert other.get(charge.key_for("o-new", 1)) is None
    assert _ok(api.post("/api/resume", json={"tool": "charge"})) == {"lifted": 1, "pauses": []}
    assert _ok(api.post("/api/resume", json={"all": True})) == {"lifted": 0, "pauses": []}


def test_while_the_store_is_down_reads_answer_503_and_the_stream_says_so(tmp_path: Path) -> None:
    """A private Redis is stopped under a running dashboard: every read answers 503 naming the store,
    the event stream sends ``unavailable``; once the server is back (its data kept) the stream sends
    the counts again and the reads answer."""
    server = PrivateRedis(tmp_path, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        seed(server.url, orders=1, reviews=1, spread_hours=0)
        with (
            Ledger.open(server.url) as ledger,
            serve_in_thread(create_app(ledger, poll_seconds=0.05)) as dashboard,
            httpx.Client(base_url=dashboard.url, timeout=30) as client,
            client.stream("GET", "/api/events") as response,
        ):
            events = Events(response)
            name, counts = events.next()
            assert name == "counts" and counts["total"] == 4
            server.stop()
            name, down = events.next()
            assert name == "unavailable" and "error" in down
            for path in ("/api/counts", "/api/records", "/api/stats"):
                answer = client.get(path)
                assert answer.status_code == 503 and answer.json()["error"], (path, answer.text)
            server.start()
            assert events.next() == ("counts", counts)
            assert _ok(client.get("/api/records", params={"sort": "age"}))["more"] == 0
    finally:
        server.stop()


def test_the_command_reconciles_with_the_tools_of_its_app(sqlite_url: str, tmp_path: Path) -> None:
    """``onceonly dashboard --app module:ledger``: "Reconcile now" settles the unknown shipment through
    the app's probe (confirmed, with its result), as ``onceonly reconcile --app`` would."""
    made = seed(sqlite_url, orders=1, reviews=0, spread_hours=0)
    (tmp_path / "shipping.py").write_text(
        "import os\nimport onceonly\n\nledger = onceonly.Ledger.open(os.environ['SHIPPING_URL'])\n\n\n"
        "@ledger.tool(name='ship', on_unknown='probe', probe=lambda args, key: {'shipped': args['order']})\n"
        "def ship(order: str) -> None:\n    raise AssertionError('the reconciler probes; it never ships again')\n"
    )
    app = ["--app", "shipping:ledger", "--app-dir", str(tmp_path)]
    with running(sqlite_url, *app, env={"SHIPPING_URL": sqlite_url}) as dashboard:
        report = _ok(httpx.post(f"{dashboard.url}/api/reconcile", json={"by": "alice"}, timeout=60))
    assert report["tools"] == ["ship"] and "note" not in report
    (line,) = [r for r in report["records"] if r["key"] == made.unknown]
    assert (line["before"], line["after"]) == ("unknown", "confirmed")
    with Ledger.open(sqlite_url) as ledger:
        rec = ledger.get(made.unknown)
    assert rec is not None and rec.result == {"shipped": "o-1"} and rec.history[-1]["by"] == "reconcile@dashboard:alice"


def test_an_argument_value_matches_whole_at_any_depth() -> None:
    """``ops.args_match``: a value inside a model or a list matches by its field's name or alone;
    strings compare whole, numbers, ``true`` and ``null`` as JSON writes them; stored arguments that do
    not decode match nothing (the search goes on)."""
    args = {"req": {"order": "ord-17", "lines": [{"sku": "A-1", "qty": 2}]}, "rush": True, "note": None}
    rec = timed_charge("default:charge:x", time.time(), 0.1)
    rec = dataclasses.replace(rec, args_json=json.dumps(args))
    for term in ("ord-17", "order=ord-17", "sku=A-1", "A-1", "qty=2", "2", "2.0", "rush=true", "note=null", " ord-17 "):
        assert ops.args_match(rec, term), term
    for term in ("ord-1", "req=ord-17", "sku=2", "qty=two", "rush=1", "note=", "ORD-17", "nan", "inf"):
        assert not ops.args_match(rec, term), term
    assert not ops.args_match(dataclasses.replace(rec, args_json="[not json"), "ord-17")


def test_resolve_many_as_confirmed_gives_each_the_result(api: httpx.Client, store_url: str, seeded: Seeded) -> None:
    """Picked records resolved as having happened each get the result given (its JSON), ``via="resolve"``;
    ``reset`` with ``confirmed`` is refused whole, as for one record."""
    picked = [{"key": k} for k in seeded.review]
    body = {"records": picked, "confirmed": {"refunded": True}, "by": "bob", "why": "the bank shows the refund"}
    refused = api.post("/api/resolve-many", json={**body, "reset": True})
    assert refused.status_code == 400 and '"reset" goes with "failed"' in refused.json()["error"]
    done = _ok(api.post("/api/resolve-many", json=body))
    assert done["count"] == {"resolved": 2, "refused": 0}
    with Ledger.open(store_url) as ledger:
        for key in seeded.review:
            rec = ledger.get(key)
            assert rec is not None and rec.state is State.CONFIRMED and rec.via == "resolve"
            assert rec.result == {"refunded": True} and rec.history[-1]["by"] == "bob"
