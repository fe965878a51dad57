"""The store mode of ``IdempotencyMiddleware``: claim the key in the store, run the application,
then store its response (or release the key); a completed key is replayed, a held one answers 409.

The claim is renewed while the application runs, by a task on the event loop (see ``_beat``), and the
response is stored before its last chunk goes out (``_capture.Capture``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Collection

from onceonly import states as st
from onceonly.errors import StoreCorrupt, StoreError
from onceonly.keys import canonical_json
from onceonly.plan import landed
from onceonly.runtime import new_owner
from onceonly.states import HELD, Record, State

from ._answers import TOOL, Problems, replaying, send_all
from ._calls import StoreCalls
from ._capture import Capture
from ._http import (
    ASGIApp,
    ClientHasher,
    IdempotencyContext,
    Message,
    Receive,
    Scope,
    Send,
    StoredResponse,
    check_client_secret,
)
from ._status import KeyStatus

__all__ = ["Held", "StoredMode"]

log = logging.getLogger("onceonly.server")

#: Where the store mode keeps the client secret it made, after ``key_prefix:``.
_SECRET_KEY = "meta:client-secret"
#: Pauses between tries to store a response after the store failed the write (and the re-read shows
#: the claim still ours): about 0.8 s in all, enough for a blip, short enough to hold the last chunk.
_COMPLETE_DELAYS = (0.05, 0.2, 0.5)


class Held:
    """A claim this process holds while the application runs; ``record`` is the latest version written.

    Not a ``runtime.Lease``: its renewal is a task on the event loop (``StoredMode._beat``) guarded by an
    ``asyncio.Lock``, where a lease's heartbeat is a thread guarded by a thread lock.
    """

    __slots__ = ("beat", "done", "lock", "record", "timer")

    def __init__(self, record: Record) -> None:
        self.record = record
        self.lock = asyncio.Lock()
        self.done = False
        self.timer: asyncio.TimerHandle | None = None
        self.beat: asyncio.Task[None] | None = None


class StoredMode:
    """One middleware's store mode: the application, its store calls, problems and the options that
    shape its records (see ``IdempotencyMiddleware`` for each)."""

    def __init__(
        self,
        app: ASGIApp,
        calls: StoreCalls,
        problems: Problems,
        *,
        key_prefix: str,
        processing_timeout: float,
        ttl: float,
        max_stored_body: int,
        replay_headers: Collection[str],
        release_statuses: Collection[int],
        clock: Callable[[], float],
    ) -> None:
        self.app = app
        self.calls = calls
        self.problems = problems
        self.key_prefix = key_prefix
        self.processing_timeout = processing_timeout
        self.ttl = ttl
        self.max_stored_body = max_stored_body
        self.replay_headers = replay_headers
        self.release_statuses = release_statuses
        self.clock = clock
        #: The record that keeps the client secret this mode made (``client_hasher``).
        self.secret_key = f"{key_prefix}:{_SECRET_KEY}"

    async def run(self, scope: Scope, body: bytes, receive: Receive, send: Send, ctx: IdempotencyContext) -> None:
        """Answer one request with a key: replay, refuse, or claim it and run the application."""
        try:
            got = await self._claim(scope, ctx)
        except StoreError as exc:
            await send_all(send, self.problems.store_failed(exc, ctx.store_key, ctx.key))
            return
        if not isinstance(got, Held):
            await send_all(send, got)
            return
        held = got
        loop = asyncio.get_running_loop()
        held.timer = loop.call_later(self.processing_timeout / 3, self._start_beat, held)
        response = Capture(self, held, ctx, send)
        # Every way out stores or releases the key, and both stop the renewal timer and beats first.
        try:
            await self.app(scope, replaying(body, receive, until=response.unheard), response.send)
        except BaseException:
            if not response.finished:
                response.finished = True
                await self.release(held, "the application raised")
            raise
        finally:
            response.unheard.set()
        if not response.finished:
            await self.release(held, "the application returned without a complete response")

    async def _claim(self, scope: Scope, ctx: IdempotencyContext) -> Held | tuple[Message, Message]:
        now = self.clock()
        owner = new_owner()
        args_json = canonical_json(
            {"method": scope["method"].upper(), "path": scope["path"], "query": scope["query_string"].decode("latin-1")}
        )
        fresh = st.new_record(
            key=ctx.store_key,
            scope=f"{self.key_prefix}:{ctx.client}",
            tool=TOOL,
            fingerprint=ctx.fingerprint,
            args_json=args_json,
            state=State.IN_FLIGHT,
            owner=owner,
            now=now,
            lease_seconds=self.processing_timeout,
            reason="request",
        )
        for _ in range(8):  # compare-and-set rounds; each lost round means another request moved the key
            current = await self.calls.call("claim", fresh)
            if current is None:
                return Held(fresh)
            got = self._against(scope, ctx, current, owner)
            if not isinstance(got, Record):
                return got
            new = st.replace_args(got, fingerprint=ctx.fingerprint, args_json=args_json)
            if await self.calls.call("swap", new, current):
                return Held(new)
        return self.problems.in_flight(ctx)

    def _against(
        self, scope: Scope, ctx: IdempotencyContext, current: Record, owner: str
    ) -> Record | tuple[Message, Message]:
        """What a claim that found ``current`` does: the record to write over it, or the answer."""
        now = self.clock()
        if current.state is State.CONFIRMED and current.is_expired(now):
            return st.renew(
                current, state=State.IN_FLIGHT, owner=owner, now=now, lease_seconds=self.processing_timeout,
                reason="expired",
            )  # fmt: skip
        if current.fingerprint != ctx.fingerprint:
            return self.problems.conflict(scope, ctx)
        if current.state is State.CONFIRMED:
            try:
                return StoredResponse.from_json(current.result_json or "").messages(replayed=True)
            except ValueError:
                log.exception("onceonly.server: %s holds no readable response", ctx.store_key)
                return self.problems.unreadable(
                    ctx.key, "completed", "this key was completed but its stored response cannot be read"
                )
        if current.state in HELD and not current.lease_expired(now):
            return self.problems.in_flight(ctx)
        if current.state not in (State.IN_FLIGHT, State.PENDING, State.FAILED, State.UNKNOWN):
            # needs_review / abandoned: only a person puts an http key there; never run it blindly.
            return self.problems.in_flight(ctx)
        if current.state in HELD:
            log.warning(
                "onceonly.server: %s was held by %s whose claim went stale (the server stopped?): "
                "running the request again",
                ctx.store_key,
                current.lease_owner,
            )
        return st.claim_again(
            current,
            state=State.IN_FLIGHT,
            owner=owner,
            now=now,
            lease_seconds=self.processing_timeout,
            reason="stale or released: claimed again",
        )

    async def client_hasher(self) -> ClientHasher:
        """The client secret kept in the store, made on first use: one conditional write, so that
        servers starting together keep the first one written and all hash clients alike."""
        key = self.secret_key
        now = self.clock()
        owner = new_owner()
        made = st.new_record(
            key=key, scope=f"{self.key_prefix}:meta", tool=TOOL, fingerprint=st.SECRET_FINGERPRINT, args_json="{}",
            state=State.IN_FLIGHT, owner=owner, now=now, lease_seconds=0.0, reason="client secret",
        )  # fmt: skip
        made = st.confirm(
            made, result_json=json.dumps({"client_secret": secrets.token_hex(32)}), now=now, ttl=None,
            via="made", by=owner,
        )  # fmt: skip
        kept = await self.calls.call("claim", made) or made
        return self._hasher_of(kept)

    async def kept_client_hasher(self) -> ClientHasher | None:
        """The client secret kept in the store, or ``None`` when none was made yet (then no key was
        ever stored): a read only, for the status endpoint, which must write nothing."""
        kept = await self.calls.call("get", self.secret_key)
        return None if kept is None else self._hasher_of(kept)

    def _hasher_of(self, kept: Record) -> ClientHasher:
        try:
            secret = check_client_secret(bytes.fromhex(json.loads(kept.result_json or "")["client_secret"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreCorrupt(
                f"{kept.key} holds no client secret of IdempotencyMiddleware ({exc}): it was written by something "
                "else. Nothing was changed: delete that record (a new secret is then made) or pass client_secret="
            ) from exc
        return ClientHasher(secret)

    async def status(self, store_key: str) -> KeyStatus:
        """What a retry of ``store_key`` (``http:CLIENT:k:KEY``) meets, read from its record; writes nothing."""
        return key_status(await self.calls.call("get", store_key), self.clock())

    async def complete(self, held: Held, stored: StoredResponse) -> None:
        """Store the response of the claim ``held`` (it is then replayed), retrying a failed write briefly."""
        await self._stop_beats(held)
        rec = held.record
        result_json = stored.to_json()
        # One write per version of the claim, sent again as is: an earlier try that landed unseen
        # (its answer and the read after it lost) is then exactly the record ``landed`` looks for.
        new = st.confirm(rec, result_json=result_json, now=self.clock(), ttl=self.ttl, via="run", by=rec.lease_owner)
        for pause in (*_COMPLETE_DELAYS, None):
            try:
                ok, current = await self.calls.swap_now(new, rec)
            except StoreError:  # the write failed and so did the read after it
                current = rec
                if pause is None:
                    log.exception(
                        "onceonly.server: could not store the response of %s: its claim will go stale after "
                        "%.0f s and a retry will run the request again",
                        rec.key,
                        self.processing_timeout,
                    )
                    return
            else:
                if ok or landed(new, current):  # landed: an earlier try landed unseen, this one was refused by it
                    held.record = new
                    return
                if not is_ours(current, rec):
                    log.warning(
                        "onceonly.server: the claim on %s was taken over while the request ran (it ran longer "
                        "than processing_timeout without renewal): the request may have run twice",
                        rec.key,
                    )
                    return
                if pause is None:
                    log.error(
                        "onceonly.server: the store kept refusing the response of %s: its claim will go stale "
                        "after %.0f s and a retry will run the request again",
                        rec.key,
                        self.processing_timeout,
                    )
                    return
            assert current is not None
            if current.version != rec.version:
                rec = held.record = current  # a renewal of ours landed unseen: write over it at once
                new = st.confirm(
                    rec, result_json=result_json, now=self.clock(), ttl=self.ttl, via="run", by=rec.lease_owner
                )
                continue
            await asyncio.sleep(pause)  # the write did not land: give the store a moment

    async def release(self, held: Held, why: str) -> None:
        """Delete the claim ``held``, so that a retry runs the request again; ``why`` is logged."""
        await self._stop_beats(held)
        rec = held.record
        call = self.calls.call
        try:
            released = await call("delete", rec.key, rec.version)
            if not released:
                # A renewal of ours may have landed unseen: release the version that is there.
                current = await call("get", rec.key)
                if is_ours(current, rec):
                    released = await call("delete", rec.key, current.version)
        except StoreError:
            log.exception(
                "onceonly.server: could not release %s after %s: retries get 409 until the claim goes stale (%.0f s)",
                rec.key,
                why,
                self.processing_timeout,
            )
            return
        if released:
            log.debug("onceonly.server: released %s: %s", rec.key, why)

    # --- renewing a claim while the application runs ----------------------------------------------
    # Not ``runtime.Heartbeats``: its thread calls the store's sync face, while these renewals go the
    # way ``store_calls`` says (the async face's connections belong to this loop), and a renewal refused
    # while the claim is still ours (``is_ours``) goes on from the stored version rather than giving up.

    def _start_beat(self, held: Held) -> None:
        if not held.done:
            held.beat = asyncio.ensure_future(self._beat(held))

    async def _beat(self, held: Held) -> None:
        pause = self.processing_timeout / 3
        while True:
            wait = pause
            async with held.lock:
                if held.done:
                    return
                rec = held.record
                new = st.extend_lease(rec, now=self.clock(), lease_seconds=self.processing_timeout)
                try:
                    ok, current = await self.calls.swap_now(new, rec)
                except StoreError as exc:
                    log.warning("onceonly.server: could not renew the claim on %s: %s", rec.key, exc)
                else:
                    if ok:
                        held.record = new
                    elif is_ours(current, rec):
                        # An earlier renewal landed unseen, or this one was refused: go on from the
                        # version that is there, and renew it now rather than at the next beat.
                        assert current is not None
                        wait = 0.0 if current.version != rec.version else min(pause, 0.5)
                        held.record = current
                    else:
                        log.warning("onceonly.server: the claim on %s was taken over by another request", rec.key)
                        return
            await asyncio.sleep(wait)

    async def _stop_beats(self, held: Held) -> None:
        if held.timer is not None:
            held.timer.cancel()
        # The lock waits for a renewal that is writing right now, so its new version is the one we use.
        async with held.lock:
            held.done = True
        if held.beat is not None:
            held.beat.cancel()


def is_ours(current: Record | None, held: Record) -> bool:
    """Whether the stored record is still the claim ``held`` made (its owner token is unique to it)."""
    return (
        current is not None
        and current.state is State.IN_FLIGHT
        and current.lease_owner == held.lease_owner
        and current.fence == held.fence
    )


def key_status(rec: Record | None, now: float) -> KeyStatus:
    """The ``KeyStatus`` of the middleware's record of a key (``None``: no record), at ``now``."""
    if rec is None:
        return KeyStatus("no-record", "runs")
    if rec.state is State.CONFIRMED:
        if rec.is_expired(now):
            return KeyStatus("expired", "runs", expires_at=rec.expires_at)
        try:
            status: int | None = StoredResponse.from_json(rec.result_json or "").status
        except ValueError:
            return KeyStatus("unknown", "refused", stored_at=rec.updated_at)
        return KeyStatus("completed", "replays", status, stored_at=rec.updated_at, expires_at=rec.expires_at)
    if rec.state in HELD:
        if rec.lease_expired(now):
            # The server that held it stopped mid-request: whether its effects landed is not known,
            # and a retry runs the request again.
            return KeyStatus("unknown", "runs")
        return KeyStatus("processing", "waits", expires_at=rec.lease_until)
    if rec.state in (State.FAILED, State.UNKNOWN):
        return KeyStatus("unknown", "runs")
    return KeyStatus("unknown", "waits")  # needs_review / abandoned: a person holds it (see _against)
