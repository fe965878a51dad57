"""The four ways the demo's agents call "create ticket", side by side.

- ``naive``: a plain POST with a client timeout, retried on any error. No key: a lost answer or an
  answer later than the timeout makes the retry create the ticket again.
- ``key-only``: the sources' first layer alone. One ``Idempotency-Key`` per logical call, stable
  across its retries (``onceonly.http.Client``), against a server whose idempotency middleware is
  on. It fixes lost and late answers; it cannot know that a re-planned call or a second agent asks
  for the same ticket, since each of them makes a new key. And it needs that middleware.
- ``onceonly``: the tool guarded by a ledger, keyed by the business fields (session, title), its
  unknowns settled by a probe (``GET /tickets?session_id=&title=``) and, at the end, by the
  reconciler. Against the server with its middleware *off*: the hardest case, where only the
  agent's side can prevent a duplicate. A re-plan in other words has another title, so another key.
- ``onceonly+server``: the same ledger and key, with no probe written: the tool's HTTP client asks the
  server what became of its key (``onceonly.http``'s ``probe="server"``), against the server with its
  middleware and key status path on (``GET /idempotency-keys/{key}``). A lost or late answer is
  settled by the server's word: completed → its stored answer, replayed; never arrived → sent once.
- ``onceonly+similar``: the ``onceonly`` row, with ``similar=Similar(fields=("title",))`` and
  ``on_similar="replay"``: a call whose title is like an earlier call's of the same session is taken
  for it (docs/similar.md). Needs the ``similar`` extra (rapidfuzz); without it the run skips it.

Each strategy answers an ask with ``"done"``, ``"failed"`` (definitely not done) or ``"unsettled"``
(it does not know). Its agents run in threads; every HTTP client here is per thread.

Who sends a request is part of what the ticket service draws its fault from (with the body, and how
many times that request came before: ``onceonly.tickets.faults``). A naive or key-only agent is a
client of its own (``Authorization: Bearer demo-agent-N``): two agents asking for one ticket at once
send two requests, each meeting its own faults, whichever arrives first. onceonly's agents share one
tool, which speaks for the app (``demo-app``): its requests for a ticket go one at a time, whichever
agent's call sends them, so the nth of them meets the same fault in every run.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from onceonly._install import install_hint
from onceonly.demo.workload import Ask, Workload
from onceonly.errors import AttemptsExhausted, InProgress, KeyConflict, OutcomeUnknown
from onceonly.http import Client as KeyClient
from onceonly.http import Transport, is_replayed
from onceonly.ledger import Ledger, Tool
from onceonly.plan import NOT_FOUND
from onceonly.policy import Retry
from onceonly.settle import ReconcileReport, reconcile
from onceonly.similar import Similar
from onceonly.states import State

__all__ = [
    "STRATEGIES", "KeyOnly", "Naive", "OnceOnly", "OnceOnlyServer", "OnceOnlySimilar", "Strategy", "unavailable"
]  # fmt: skip

DONE, FAILED, UNSETTLED = "done", "failed", "unsettled"
#: How long an agent's first request (a read, before the clock starts) may take on a busy machine.
WARM_UP_SECONDS = 60.0


class Strategy:
    """What the runner needs from a strategy. Subclasses implement ``ask``."""

    name = ""
    #: whether the ticket server runs its idempotency middleware for this strategy
    idempotency = False

    def __init__(self, *, timeout: float, attempts: int = 5) -> None:
        self.timeout = timeout
        self.attempts = attempts
        self.url = ""
        self._local = threading.local()
        self._clients: list[Any] = []
        self._lock = threading.Lock()

    def start(self, url: str, workdir: Path) -> None:
        """The server is up at ``url``; ``workdir`` is this strategy's own directory."""
        self.url = url

    def ask(self, ask: Ask) -> str:
        """Run one ask in the calling agent's thread: ``"done"``, ``"failed"`` or ``"unsettled"``."""
        raise NotImplementedError

    def warm(self) -> None:
        """In an agent's thread, before its first ask: make its client and connect. A cold start (a
        client's TLS context, the service's first requests) in the middle of the first asks, all at
        once, can outlast the client's timeout on a busy machine and count as a lost answer; here it
        has all the time it needs."""
        client = self._client(self._new_client)
        client.get("/tickets", params={"session_id": "demo-warm-up"}, timeout=WARM_UP_SECONDS).raise_for_status()

    def _new_client(self) -> Any:
        """This strategy's HTTP client for one agent's thread."""
        return httpx.Client(base_url=self.url, timeout=self.timeout)

    def finish(self, workload: Workload) -> dict[int, str] | None:
        """After every agent is done: the final status of each operation of ``workload`` (by its
        index), when the strategy knows better than its asks' answers."""
        return None

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def _client(self, make: Callable[[], Any]) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = make()
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client


def _as_agent(ask: Ask) -> dict[str, str]:
    """The headers of a request sent by ``ask``'s agent, a client of its own."""
    return {"Authorization": f"Bearer demo-agent-{ask.agent}"}


class Naive(Strategy):
    """POST, and on any error or 5xx try again (up to ``attempts``), with a short backoff."""

    name = "naive"
    idempotency = False

    def ask(self, ask: Ask) -> str:
        client: httpx.Client = self._client(self._new_client)
        body = {"session_id": ask.session_id, "title": ask.title, "body": ask.body}
        for attempt in range(self.attempts):
            try:
                response = client.post("/tickets", json=body, headers=_as_agent(ask))
            except httpx.HTTPError:
                pass  # timeout, reset: "it failed", says the naive loop, and tries again
            else:
                if response.status_code == 201:
                    return DONE
                if response.status_code < 500:
                    return FAILED
            time.sleep(0.02 * 2**attempt)
        return UNSETTLED


class KeyOnly(Strategy):
    """One fresh key per logical call, kept across its retries; the server's middleware dedups them."""

    name = "key-only"
    idempotency = True

    def _new_client(self) -> KeyClient:
        return KeyClient(
            self.url, timeout=self.timeout, retry=Retry(attempts=self.attempts, base=0.05, cap=1.0), wait=30.0
        )

    def ask(self, ask: Ask) -> str:
        client: KeyClient = self._client(self._new_client)
        body = {"session_id": ask.session_id, "title": ask.title, "body": ask.body}
        try:
            # A new logical call: a new key (prefix:session:call, as the sources make them). A re-planned
            # call is a new call to this agent, and a second agent has its own keys.
            key = f"demo:{ask.session_id}:{ask.call_id}"
            client.post("/tickets", json=body, headers=_as_agent(ask), idempotency_key=key)
        except httpx.HTTPStatusError as exc:
            return FAILED if exc.response.status_code < 500 else UNSETTLED
        except (httpx.HTTPError, InProgress, KeyConflict):
            return UNSETTLED
        return DONE


#: The one client onceonly's tool is, whichever agent calls it.
_AS_APP = {"Authorization": "Bearer demo-app"}


class OnceOnly(Strategy):
    """The agents' tool guarded by a ledger; unknowns settled by a probe, then by the reconciler."""

    name = "onceonly"
    idempotency = False  # the hardest case: the server dedups nothing
    #: ``similar=`` of the tool: none here, the key compares exactly
    similar: Similar | None = None

    def __init__(self, *, timeout: float, attempts: int = 6, url: str | None = None, settle: float = 1.0) -> None:
        super().__init__(timeout=timeout, attempts=attempts)
        self.ledger_url = url
        self.settle = settle
        self.ledger: Ledger | None = None
        self.tool: Tool[..., Any] | None = None
        self.report: ReconcileReport | None = None
        #: Operations by how their record was settled: its ``via`` (``run``, ``probe``, ``late``,
        #: ``reconcile-probe``…), or its state when it is not confirmed.
        self.settled: dict[str, int] = {}
        #: Calls taken for an earlier, similar call (``Outcome.similar_to``): run nothing, got its ticket.
        self.similar_replayed = 0

    def start(self, url: str, workdir: Path) -> None:
        super().start(url, workdir)
        # A scope of its own, so that runs on a shared store (Redis, PostgreSQL) never meet.
        scope = f"demo-{uuid.uuid4().hex[:12]}"
        self.ledger = Ledger.open(self.ledger_url or f"sqlite:///{workdir / 'ledger.db'}", scope=scope)

        def http() -> httpx.Client:
            return self._client(self._new_client)  # type: ignore[no-any-return]

        def find_ticket(args: dict[str, Any], key: str) -> Any:
            """The probe: ask the service for the ticket by its business key."""
            params = {"session_id": args["session_id"], "title": args["title"]}
            response = http().get("/tickets", params=params, headers=_AS_APP)
            response.raise_for_status()
            found = response.json()["tickets"]
            return found[0] if found else NOT_FOUND

        @self.ledger.tool(
            name="create_ticket",
            key=("session_id", "title"),  # the business key: a re-plan or a second agent is the same call
            on_unknown="probe",
            probe=find_ticket,
            settle=self.settle,  # longer than the server takes to finish a request it received
            on_conflict="replay",  # a re-worded body for the same ticket gets the ticket made
            similar=self.similar,
            on_similar="replay",  # a re-worded title too, when similar= is set
            retry=Retry(attempts=self.attempts, base=0.05, cap=1.0),
            wait=60.0,
        )
        def create_ticket(session_id: str, title: str, body: str, *, idempotency_key: str) -> dict[str, Any]:
            response = http().post(
                "/tickets",
                json={"session_id": session_id, "title": title, "body": body},
                headers={"Idempotency-Key": idempotency_key, **_AS_APP},  # the key is sent on; this server ignores it
            )
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result

        self.tool = create_ticket

    def ask(self, ask: Ask) -> str:
        assert self.tool is not None
        try:
            outcome = self.tool.outcome(ask.session_id, ask.title, ask.body)
        except (OutcomeUnknown, InProgress):
            return UNSETTLED
        except AttemptsExhausted:
            return FAILED
        except httpx.HTTPStatusError:
            return FAILED  # a definite refusal (4xx), recorded as failed
        if outcome.similar_to is not None:
            with self._lock:
                self.similar_replayed += 1
        return DONE

    def finish(self, workload: Workload) -> dict[int, str]:
        """Run the reconciler for what stayed unsettled, then read each operation's records: one per
        title it was asked with, when the key compares exactly; a title taken for an earlier, similar
        one has none of its own."""
        assert self.ledger is not None and self.tool is not None
        self.report = reconcile(self.ledger, scope=self.ledger.scope, wait=self.settle + 2.0, review_after=3600)
        statuses: dict[int, str] = {}
        for op, keys in enumerate(workload.titles()):
            records = [self.ledger.get(self.tool.key_for(session_id, title, "")) for session_id, title in keys]
            first = records[0]  # the title first asked for: how the operation was settled
            how = "no record" if first is None else first.via or first.state.value
            how = "late" if how.startswith("late:") else how
            self.settled[how] = self.settled.get(how, 0) + 1
            states = {rec.state for rec in records if rec is not None}
            if State.CONFIRMED in states:
                statuses[op] = DONE
            elif states and states <= {State.FAILED, State.ABANDONED}:
                statuses[op] = FAILED
            else:
                statuses[op] = UNSETTLED
        return statuses

    def close(self) -> None:
        super().close()
        if self.ledger is not None:
            self.ledger.close()


class OnceOnlyServer(OnceOnly):
    """The ledger of ``OnceOnly`` with no probe of its own: its requests carry the ledger's key, and an
    unknown outcome is settled by asking the server about that key (``probe="server"``); what a dead
    call leaves, the reconciler settles the same way (``reports_dispatch=True`` records where it went)."""

    name = "onceonly+server"
    idempotency = True  # the server keeps keys and answers GET /idempotency-keys/{key}

    def __init__(self, *, timeout: float, attempts: int = 6, url: str | None = None, settle: float = 1.0) -> None:
        super().__init__(timeout=timeout, attempts=attempts, url=url, settle=settle)
        #: Calls whose answer was lost or late and came back as the server's replay of it.
        self.replayed_by_server = 0

    def _new_client(self) -> httpx.Client:
        # No blind re-send: the server's word on the key decides (a replay lost again is asked again).
        transport = Transport(probe="server", resend_unknown=False, retry=Retry(attempts=4, base=0.05, cap=1.0))
        return httpx.Client(base_url=self.url, timeout=self.timeout, transport=transport)

    def start(self, url: str, workdir: Path) -> None:
        Strategy.start(self, url, workdir)
        scope = f"demo-{uuid.uuid4().hex[:12]}"
        self.ledger = Ledger.open(self.ledger_url or f"sqlite:///{workdir / 'ledger.db'}", scope=scope)

        @self.ledger.tool(
            name="create_ticket",
            key=("session_id", "title"),
            reports_dispatch=True,  # the transport reports the dispatch and records where it went
            on_conflict="replay",
            retry=Retry(attempts=self.attempts, base=0.05, cap=1.0),
            wait=60.0,
        )
        def create_ticket(session_id: str, title: str, body: str) -> dict[str, Any]:
            client: httpx.Client = self._client(self._new_client)
            response = client.post(
                "/tickets", json={"session_id": session_id, "title": title, "body": body}, headers=_AS_APP
            )
            response.raise_for_status()
            if is_replayed(response):
                with self._lock:
                    self.replayed_by_server += 1
            result: dict[str, Any] = response.json()
            return result

        self.tool = create_ticket

    def warm(self) -> None:
        client: httpx.Client = self._client(self._new_client)
        client.get("/tickets", params={"session_id": "demo-warm-up"}, timeout=WARM_UP_SECONDS).raise_for_status()

    def finish(self, workload: Workload) -> dict[int, str]:
        assert self.ledger is not None and self.tool is not None
        self.report = reconcile(
            self.ledger, scope=self.ledger.scope, wait=self.settle + 2.0, review_after=3600, server_headers=_AS_APP
        )
        statuses: dict[int, str] = {}
        for op, keys in enumerate(workload.titles()):
            records = [self.ledger.get(self.tool.key_for(session_id, title, "")) for session_id, title in keys]
            first = records[0]
            how = "no record" if first is None else first.via or first.state.value
            self.settled[how] = self.settled.get(how, 0) + 1
            states = {rec.state for rec in records if rec is not None}
            if State.CONFIRMED in states:
                statuses[op] = DONE
            elif states and states <= {State.FAILED, State.ABANDONED}:
                statuses[op] = FAILED
            else:
                statuses[op] = UNSETTLED
        if self.replayed_by_server:  # ran, its answer lost: the server's word and its replay settled it
            self.settled["run"] = self.settled.get("run", 0) - self.replayed_by_server
            self.settled["server"] = self.replayed_by_server
        return statuses


class OnceOnlySimilar(OnceOnly):
    """``OnceOnly`` whose tool also takes a call with a similar title, in the same session, for the
    earlier call (``similar=``, ``on_similar="replay"``): a re-plan in other words gets the ticket made."""

    name = "onceonly+similar"

    def __init__(self, *, timeout: float, attempts: int = 6, url: str | None = None, settle: float = 1.0) -> None:
        super().__init__(timeout=timeout, attempts=attempts, url=url, settle=settle)
        self.similar = Similar(fields=("title",))  # the defaults: threshold 0.85, window 3600 s


def unavailable(name: str) -> str | None:
    """Why strategy ``name`` cannot run here (a missing extra, and how to install it), or ``None``."""
    if name != OnceOnlySimilar.name:
        return None
    try:
        import rapidfuzz  # noqa: F401  (Similar's default score)
    except ImportError:
        return f"it needs rapidfuzz, which is not installed: {install_hint('similar')}"
    return None


#: name → factory(timeout=, url=, settle=)
STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "naive": lambda *, timeout, url=None, settle=1.0: Naive(timeout=timeout),
    "key-only": lambda *, timeout, url=None, settle=1.0: KeyOnly(timeout=timeout),
    "onceonly": lambda *, timeout, url=None, settle=1.0: OnceOnly(timeout=timeout, url=url, settle=settle),
    "onceonly+server": lambda *, timeout, url=None, settle=1.0: OnceOnlyServer(timeout=timeout, url=url, settle=settle),
    "onceonly+similar": lambda *, timeout, url=None, settle=1.0: OnceOnlySimilar(
        timeout=timeout, url=url, settle=settle
    ),
}
