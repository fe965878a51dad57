"""onceonly.http's reach beyond its own client: transports that httpx and httpx2 clients (and SDKs built
on them) take, a requests adapter, hashed keys, and servers whose 409 means "this key was used already".

Against real servers on 127.0.0.1: the reference ticket service with its ``lost`` fault (one answer
lost after the commit), and a small ticket server that answers 409 to a used key (both in
tests/_http_servers.py). Each
scenario shows the duplicate a call makes without onceonly's key, and the one ticket it makes with it.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import requests

import onceonly
from onceonly import Retry
from onceonly.http import (
    AsyncClient,
    AsyncTransport,
    Client,
    KeyAlreadyUsed,
    RequestsAdapter,
    Transport,
    hash_key,
    header_key,
    is_replayed,
)
from onceonly.policy import Verdict, classify, conflict_classifier
from onceonly.states import State
from tests._http_servers import TICKET, Service, fixture_ledger, fixture_tickets, fixture_used, open_ledger  # noqa: F401 (fixtures)
from tests.test_http import Scripted, Sleeps, fixture_scripted  # noqa: F401 (a fixture)


class TicketsSDK:
    """An SDK in the style of the generated ones: it takes an ``http_client``, builds a new request for
    each of its own retries, and sends an idempotency key only when the caller gives one."""

    def __init__(self, base_url: str, http_client: Any, max_retries: int = 0) -> None:
        self.base_url = base_url
        self.http = http_client
        self.max_retries = max_retries

    def create_ticket(self, ticket: dict[str, str], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        for retry in range(self.max_retries + 1):
            try:
                response = self.http.post(f"{self.base_url}/tickets", json=ticket, headers=headers)
                break
            except Exception:
                if retry == self.max_retries:
                    raise
        response.raise_for_status()
        out: dict[str, Any] = response.json()
        return out


# --- transports: SDK-style clients carry the ledger's key --------------------------------------------


@pytest.mark.parametrize("library", ["httpx", "httpx2"])
def test_sdk_style_client_on_transport_makes_one_ticket(
    tickets: Service, ledger: onceonly.Ledger, library: str
) -> None:
    """An SDK-style client inside a guarded tool; the first answer is lost after the commit.

    Without onceonly's key (a fresh key per call, as callers do), the SDK gives up, the ledger sends
    the tool again, and the new call's new key makes a second ticket. On ``Transport`` the SDK's own
    retry (a new request) carries the ledger's key again: the service replays the one ticket. httpx2
    (the openai 3.x SDK's client) takes the same transport: its own inner transport is chosen for it."""
    http = pytest.importorskip(library)

    @ledger.tool(name="create_ticket", on_unknown="resend", key=("session_id", "title"))
    def naive(session_id: str, title: str, body: str) -> dict[str, Any]:
        with http.Client() as client:
            sdk = TicketsSDK(tickets.url, client)
            return sdk.create_ticket({"session_id": session_id, "title": title, "body": body}, uuid.uuid4().hex)

    naive(**TICKET)
    assert tickets.count() == 2, "without onceonly's key: a duplicate"

    tickets.lose_next()
    transport = Transport(retry=Retry(attempts=1))  # the SDK retries; the transport keys

    @ledger.tool(name="create_ticket_keyed", on_unknown="resend", key=("session_id", "title"))
    def keyed(session_id: str, title: str, body: str) -> dict[str, Any]:
        with http.Client(transport=transport) as client:
            sdk = TicketsSDK(tickets.url, client, max_retries=1)
            return sdk.create_ticket({"session_id": session_id, "title": title, "body": body})

    result = keyed(**TICKET)
    key = keyed.key_for(**TICKET)
    assert tickets.posted_keys()[-2:] == [key, key]
    assert tickets.count() == 3, "with it: one more ticket, not two"
    assert ledger.get(key).result == result  # type: ignore[union-attr]
    assert type(transport.inner).__module__.partition(".")[0] == library


def test_openai_sdk_on_httpx2_transport_makes_one_ticket(tickets: Service, ledger: onceonly.Ledger) -> None:
    """The openai 3.x SDK with ``http_client=httpx2.Client(transport=Transport(...))``, inside a guarded
    tool, against the ticket service; the answer is lost and the SDK does not retry (``max_retries=0``).

    The SDK raises its ``APIConnectionError`` from the reset; the guard reads it as its cause (unknown)
    and sends the tool again. With a fresh key per call that is a second ticket; with the transport the
    second request carries the ledger's key again and is replayed."""
    openai = pytest.importorskip("openai")
    httpx2 = pytest.importorskip("httpx2")

    def sdk(transport: Any = None) -> Any:
        http_client = httpx2.Client(transport=transport) if transport else httpx2.Client()
        return openai.OpenAI(base_url=tickets.url, api_key="sk-test", http_client=http_client, max_retries=0)

    naive_client = sdk()

    @ledger.tool(name="naive", on_unknown="resend")
    def naive(title: str) -> object:
        key = {"Idempotency-Key": uuid.uuid4().hex}
        return naive_client.post("/tickets", body={**TICKET, "title": title}, cast_to=object, options={"headers": key})

    naive("printer broken")
    assert tickets.count() == 2, "without onceonly's key: a duplicate"

    tickets.lose_next()
    keyed_client = sdk(Transport(retry=Retry(attempts=1)))

    @ledger.tool(name="create_ticket", on_unknown="resend")
    def create_ticket(title: str) -> object:
        return keyed_client.post("/tickets", body={**TICKET, "title": title}, cast_to=object)

    outcome = create_ticket.outcome("printer broken")
    key = create_ticket.key_for("printer broken")
    assert outcome.attempts == 2 and tickets.posted_keys()[-2:] == [key, key]
    assert tickets.count() == 3, "with it: one more ticket, not two"
    keyed_client.close()
    naive_client.close()


def test_async_transport_resends_under_the_same_key(tickets: Service, ledger: onceonly.Ledger) -> None:
    """``httpx.AsyncClient(transport=AsyncTransport())`` in an async guarded tool: the lost answer is
    sent again by the transport itself, with the ledger's key, and replayed (a plain AsyncClient that
    re-sends under a fresh key makes two tickets); the tool's second request goes as ``key#2``."""
    sleeps = Sleeps()

    async def scenario() -> tuple[httpx.Response, httpx.Response, str]:
        async with httpx.AsyncClient(base_url=tickets.url) as plain:
            for _ in range(2):  # the caller's own retry, a new key each time
                try:
                    await plain.post("/tickets", json=TICKET, headers={"Idempotency-Key": uuid.uuid4().hex})
                    break
                except httpx.TransportError:
                    continue
        assert tickets.count() == 2, "without onceonly's key: a duplicate"
        tickets.lose_next()

        @ledger.tool(name="two_tickets")
        async def two_tickets() -> None:
            async with httpx.AsyncClient(base_url=tickets.url, transport=AsyncTransport(sleep=sleeps.asleep)) as c:
                first.append(await c.post("/tickets", json=TICKET))
                first.append(await c.post("/tickets", json={**TICKET, "title": "second"}))

        first: list[httpx.Response] = []
        await two_tickets()
        return first[0], first[1], two_tickets.key_for()

    one, two, key = asyncio.run(scenario())
    assert is_replayed(one) and len(sleeps) == 1
    assert tickets.posted_keys()[-3:] == [key, key, f"{key}#2"]
    assert one.request.headers["Idempotency-Key"] == key and two.request.headers["Idempotency-Key"] == f"{key}#2"
    assert tickets.count() == 4, "with it: two tickets for two operations, none twice"


def test_transport_outside_a_guarded_call_passes_requests_through(tickets: Service) -> None:
    """Outside a guarded tool a request without a key goes untouched and once: its lost answer is the
    caller's error. A request that carries a key (the caller's) keeps it, and after its lost answer is
    sent again under it: replayed, one ticket."""
    with httpx.Client(base_url=tickets.url, transport=Transport(sleep=Sleeps())) as client:
        with pytest.raises(httpx.TransportError):
            client.post("/tickets", json=TICKET)
        assert tickets.posted_keys() == [None]
        tickets.lose_next()
        made = client.post("/tickets", json=TICKET, headers={"Idempotency-Key": "order-42"})
    assert is_replayed(made) and tickets.posted_keys() == [None, "order-42", "order-42"]
    assert tickets.count() == 1


def test_replace_keys_puts_the_ledger_key_over_an_sdk_s_own(tickets: Service, ledger: onceonly.Ledger) -> None:
    """An SDK that makes its own key for each of its calls (Stripe's habit): a re-run of the tool by
    the ledger is a new call with a new key, so a second ticket, even on the transport, which keeps a
    key the request carries. ``replace_keys=True`` puts the ledger's key in its place: one ticket."""

    def run(transport: Transport, name: str) -> str:
        @ledger.tool(name=name, on_unknown="resend")
        def create_ticket(title: str) -> dict[str, Any]:
            with httpx.Client(transport=transport) as client:
                return TicketsSDK(tickets.url, client).create_ticket({**TICKET, "title": title}, uuid.uuid4().hex)

        create_ticket("printer broken")
        return create_ticket.key_for("printer broken")

    run(Transport(retry=Retry(attempts=1)), "kept")
    assert tickets.count() == 2, "the SDK's key is kept: a duplicate"
    tickets.lose_next()
    key = run(Transport(retry=Retry(attempts=1), replace_keys=True), "replaced")
    assert tickets.posted_keys()[-2:] == [key, key]
    assert tickets.count() == 3


def test_transport_marks_a_reports_dispatch_tool_sent(scripted: tuple[Scripted, str], ledger: onceonly.Ledger) -> None:
    """A ``reports_dispatch`` tool is ``pending`` until its request goes through the transport: the
    request arrives ``in_flight``; a GET before it leaves the call ``pending``."""
    app, url = scripted
    states: list[State] = []

    @ledger.tool(name="send", reports_dispatch=True)
    def send() -> None:
        key = onceonly.current_call().key  # type: ignore[union-attr]
        app.on_request = lambda _seen: states.append(ledger.get(key).state)  # type: ignore[union-attr]
        with httpx.Client(base_url=url, transport=Transport()) as client:
            client.get("/lookup")
            client.post("/x", json={})

    send()
    assert states == [State.PENDING, State.IN_FLIGHT]
    assert app.keys() == [None, send.key_for()]


def test_a_multipart_upload_sent_again_keeps_its_key(scripted: tuple[Scripted, str], ledger: onceonly.Ledger) -> None:
    """A tool sends the same upload again after a 502 (an SDK's retry builds the request again, with a
    new multipart boundary): the same operation, the same key; another upload gets ``key#2``."""
    app, url = scripted
    app.then(502).then(201).then(201)

    @ledger.tool(name="upload")
    def upload() -> None:
        with httpx.Client(base_url=url, transport=Transport(retry=Retry(attempts=1))) as client:
            for _ in range(2):
                if client.post("/files", files={"file": ("a.txt", b"hello")}).status_code < 500:
                    break
            client.post("/files", files={"file": ("b.txt", b"other")})

    upload()
    key = upload.key_for()
    assert app.keys() == [key, key, f"{key}#2"]


def test_transport_422_problem_is_a_key_conflict(tickets: Service) -> None:
    """The same key with another body, through the transport: the service's 422 problem document is
    read, and the call raises ``KeyConflict``."""
    tickets.heal()
    with httpx.Client(base_url=tickets.url, transport=Transport()) as client:
        client.post("/tickets", json=TICKET, headers={"Idempotency-Key": "k-1"})
        with pytest.raises(onceonly.KeyConflict, match="used with another request"):
            client.post("/tickets", json={**TICKET, "body": "re-worded"}, headers={"Idempotency-Key": "k-1"})


# --- requests ----------------------------------------------------------------------------------------


def test_requests_adapter_makes_one_ticket(tickets: Service, ledger: onceonly.Ledger) -> None:
    """``requests.Session`` with ``RequestsAdapter`` mounted, inside a guarded tool; the answer is lost.

    A plain session with a fresh key per call, re-run by the ledger: two tickets. With the adapter the
    request is sent again under the ledger's key (the adapter's own retry) and replayed: one ticket."""

    @ledger.tool(name="naive", on_unknown="resend")
    def naive(title: str) -> dict[str, Any]:
        with requests.Session() as session:
            response = session.post(
                f"{tickets.url}/tickets", json={**TICKET, "title": title}, headers={"Idempotency-Key": uuid.uuid4().hex}
            )
            response.raise_for_status()
            out: dict[str, Any] = response.json()
            return out

    naive("printer broken")
    assert tickets.count() == 2, "without onceonly's key: a duplicate"

    tickets.lose_next()
    sleeps = Sleeps()

    @ledger.tool(name="create_ticket", on_unknown="resend")
    def create_ticket(title: str) -> dict[str, Any]:
        with requests.Session() as session:
            session.mount("http://", RequestsAdapter(sleep=sleeps))
            response = session.post(f"{tickets.url}/tickets", json={**TICKET, "title": title})
            response.raise_for_status()
            assert is_replayed(response)
            out: dict[str, Any] = response.json()
            return out

    outcome = create_ticket.outcome("printer broken")
    key = create_ticket.key_for("printer broken")
    assert outcome.attempts == 1 and len(sleeps) == 1
    assert tickets.posted_keys()[-2:] == [key, key]
    assert tickets.count() == 3, "with it: one more ticket, not two"


def test_requests_adapter_passes_requests_outside_a_guarded_call(scripted: tuple[Scripted, str]) -> None:
    """Outside a guarded call the adapter sends a request without a key untouched and once (the 502 is
    returned), and a request with the caller's key again under it (the 502, then the 201)."""
    app, url = scripted
    app.then(502).then(502).then(201)
    with requests.Session() as session:
        session.mount("http://", RequestsAdapter(sleep=Sleeps()))
        assert session.post(f"{url}/x", json={}).status_code == 502
        assert session.post(f"{url}/x", json={}, headers={"Idempotency-Key": "k-1"}).status_code == 201
    assert app.keys() == [None, "k-1", "k-1"]


# --- 409: "in progress" or "this key was used already" ------------------------------------------------


def _lookups() -> list[Any]:
    """The two kinds of ``lookup=``: a URL template, and a function of the key."""

    def by_function(service: Service) -> Callable[[str], Any]:
        def find(key: str) -> Any:
            response = httpx.get(f"{service.url}/tickets/by-idempotency-key/{key}")
            return response.json() if response.status_code == 200 else None

        return find

    return [
        pytest.param(lambda _s: "/tickets/by-idempotency-key/{key}", id="template"),
        pytest.param(by_function, id="function"),
    ]


FACES = ["client", "async-client", "transport", "async-transport", "requests"]


def _create(face: str, service: Service, **options: Any) -> Any:
    """POST one ticket through ``face`` with ``options``; the response (any library's)."""
    url = f"{service.url}/tickets"
    if face == "client":
        with Client(sleep=Sleeps(), **options) as client:
            return client.post(url, json=TICKET)
    if face == "transport":
        with httpx.Client(transport=Transport(sleep=Sleeps(), **options)) as client:
            return client.post(url, json=TICKET)
    if face == "async-client":

        async def post_client() -> httpx.Response:
            async with AsyncClient(sleep=Sleeps().asleep, **options) as client:
                return await client.post(url, json=TICKET)

        return asyncio.run(post_client())
    if face == "async-transport":

        async def post() -> httpx.Response:
            transport = AsyncTransport(sleep=Sleeps().asleep, **options)
            async with httpx.AsyncClient(transport=transport) as client:
                return await client.post(url, json=TICKET)

        return asyncio.run(post())
    with requests.Session() as session:
        session.mount("http://", RequestsAdapter(sleep=Sleeps(), **options))
        return session.post(url, json=TICKET)


@pytest.mark.parametrize("lookup", _lookups())
@pytest.mark.parametrize("face", FACES)
def test_409_exists_is_settled_with_the_existing_ticket(
    used: Service, ledger: onceonly.Ledger, face: str, lookup: Callable[[Service], Any]
) -> None:
    """A server that answers 409 to a used key; the answer of the first request is lost, so the
    re-send under the same key gets 409. With ``conflict_means="exists"`` and a lookup, the face fetches
    the existing ticket: the tool returns it and the ledger confirms the call with it. One ticket."""

    @ledger.tool(name="create_ticket")
    def create_ticket() -> dict[str, Any]:
        response = _create(face, used, conflict_means="exists", lookup=lookup(used))
        assert response.status_code == 200 and is_replayed(response)
        out: dict[str, Any] = response.json()
        return out

    result = create_ticket()
    key = create_ticket.key_for()
    record = ledger.get(key)
    assert record is not None and record.state is State.CONFIRMED and record.result == result
    assert result == {"id": 1, **TICKET}
    assert used.posted_keys() == [key, key] and used.count() == 1


@pytest.mark.parametrize("face", ["client", "transport"])
def test_409_without_conflict_means_is_waited_out_as_in_progress(
    used: Service, ledger: onceonly.Ledger, face: str
) -> None:
    """Today's behaviour against such a server, the default (``conflict_means="in_progress"``, the IETF
    draft): the 409 is read as "still running" and waited on until ``wait`` runs out, ``InProgress``;
    the ledger records the call failed while its ticket exists."""

    @ledger.tool(name="create_ticket")
    def create_ticket() -> object:
        return _create(face, used, wait=0.5)

    with pytest.raises(onceonly.InProgress):
        create_ticket()
    record = ledger.get(create_ticket.key_for())
    assert record is not None and record.state is State.FAILED
    assert used.count() == 1


@pytest.mark.parametrize("face", FACES)
def test_409_exists_without_a_result_is_unknown(used: Service, ledger: onceonly.Ledger, face: str) -> None:
    """``conflict_means="exists"`` with no lookup (or one that finds nothing): ``KeyAlreadyUsed``, an
    unknown outcome, which the ledger settles: its probe finds the ticket and confirms the call. The
    409 is closed before the error is raised (it held the requests adapter's connection open)."""

    def find(_args: dict[str, Any], key: str) -> Any:
        response = httpx.get(f"{used.url}/tickets/by-idempotency-key/{header_key(key)}")
        return response.json() if response.status_code == 200 else onceonly.NOT_FOUND

    @ledger.tool(name="create_ticket", on_unknown="probe", probe=find)
    def create_ticket() -> object:
        if face.endswith("client"):
            return _create(face, used, conflict_means="exists", lookup=lambda _key: None).json()
        return _create(face, used, conflict_means="exists").json()

    outcome = create_ticket.outcome()
    assert outcome.via == "probe" and outcome.result == {"id": 1, **TICKET}
    assert used.count() == 1
    gc.collect()  # a 409 left open would warn now (an unclosed socket), not in some later test
    assert classify(KeyAlreadyUsed("x", key="k")).verdict is Verdict.UNKNOWN


# --- hashed keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize("face", FACES)
def test_hash_keys_hide_the_scope_and_the_tool(tickets: Service, sqlite_url: str, face: str) -> None:
    """``hash_keys=True``: no header the service gets names the scope (a tenant's thread) or the tool;
    the key it sees is ``hash_key`` of the ledger's, the same on the re-send after the lost answer
    (one ticket, replayed). Without it the ledger's key, scope and tool name in it, goes as it is."""

    with open_ledger(sqlite_url, scope="tenant-acme.thread-7") as ledger:

        @ledger.tool(name="create_ticket")
        def create_ticket(hashed: bool) -> int:
            response = _create(face, tickets, hash_keys=hashed)
            return int(response.json()["id"])

        create_ticket(True)
        hashed_key = create_ticket.key_for(True)
        create_ticket(False)
        plain_key = create_ticket.key_for(False)
    assert tickets.count() == 2
    hashed_sent, plain_sent = tickets.seen[:2], tickets.seen[2:]
    assert [s["idempotency-key"] for s in hashed_sent] == [hash_key(hashed_key)] * 2
    for seen in hashed_sent:
        assert not [v for v in seen.values() if "acme" in v or "create_ticket" in v], seen
    assert plain_sent[0]["idempotency-key"] == plain_key and "tenant-acme" in plain_key


def test_hash_key_is_keyed_and_stable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hash_key``: 32 hex digits, the same for the same key and secret in any process, another under
    another secret (``hash_secret=`` or ``$ONCEONLY_HASH_SECRET``); options that cannot work are refused."""
    key = "tenant-acme:create_ticket:abc"
    default = hash_key(key)
    assert len(default) == 32 and int(default, 16) >= 0 and hash_key(key) == default
    assert hash_key(key, "s3cret") != default and hash_key(key, b"s3cret") == hash_key(key, "s3cret")
    monkeypatch.setenv("ONCEONLY_HASH_SECRET", "s3cret")
    assert hash_key(key) == hash_key(key, "s3cret")
    with pytest.raises(TypeError, match="hash_keys=True too"):
        Transport(hash_secret="s3cret")
    with pytest.raises(ValueError, match="hash_secret is empty; give a non-empty str or bytes"):
        Transport(hash_keys=True, hash_secret="")
    with pytest.raises(TypeError, match="hash_secret of type int is not a secret"):
        Transport(hash_keys=True, hash_secret=42)  # type: ignore[typeddict-item]


def test_options_that_cannot_work_are_refused() -> None:
    """Each face refuses a conflict meaning it does not know, a lookup without ``"exists"``, a template
    without ``{key}``, and an option it does not have, saying what to give instead."""
    with pytest.raises(ValueError, match=r"'in_progress'.*'exists'"):
        Transport(conflict_means="used")  # type: ignore[typeddict-item]
    with pytest.raises(TypeError, match="conflict_means='exists'"):
        Client(lookup="/t/{key}")
    with pytest.raises(ValueError, match="must hold"):
        AsyncTransport(conflict_means="exists", lookup="/tickets/by-key")
    with pytest.raises(ValueError, match="no other field"):
        RequestsAdapter(conflict_means="exists", lookup="/t/{key}/{id}")
    with pytest.raises(TypeError, match=r"unknown option.*hash_key"):
        Transport(hash_key=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="conflict_means="):
        conflict_classifier("used")  # type: ignore[arg-type]


def test_http_transports_example_runs() -> None:
    """examples/http_transports.py (docs/http.md): a transport under httpx and under the openai SDK, the
    requests adapter with hashed keys, and a 409 "used already" settled by a lookup: one ticket each."""
    from tests.test_examples import _run

    stdout = _run("http_transports.py")
    assert "1. httpx: replayed after the lost answer: True" in stdout
    assert "3. requests: the key sent is its hash: True" in stdout
    assert "it names neither the scope nor the tool: True" in stdout
    assert "4. 409 'used already': confirmed with the existing ticket: True" in stdout
    assert "tickets made: 1" in stdout
    assert "tickets in the service: 3" in stdout or "openai: not installed" in stdout
