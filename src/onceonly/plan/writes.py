"""The plan's writes: compare-and-set a record, and what a write whose answer was lost means.

A store error in the middle of a write is never guessed at: the record is read again, and the write
landed exactly when the stored record is the one written (``landed``). A write the store refused is
made again after a pause, a few times, then its error is raised.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from onceonly.errors import StoreError
from onceonly.plan.actions import Action, Call, Get, Sleep, Swap, landed
from onceonly.states import Record

#: Pauses after the store refused a write (it failed, and the record read back unchanged); one more
#: refusal raises. About 1.3 s in all: enough for a flicker, not a spin on a store that refuses writes.
_REFUSAL_DELAYS = (0.05, 0.25, 1.0)


def _refused(call: Call, exc: StoreError, key: str) -> Generator[Action, Any, None]:
    """The store failed a write of ``call`` and the re-read shows the record unchanged: nothing was
    written. Pause before it is made again, or, past the bound, raise the store's error."""
    n = call.refusals
    if n < len(_REFUSAL_DELAYS):
        call.refusals = n + 1
        yield Sleep(_REFUSAL_DELAYS[n] * (0.5 + call.rng.random()))
        return
    if call.ran:
        what = (
            "this call ran the tool, and its outcome is not recorded: the record keeps its lease until it "
            "runs out, then turns unknown and is settled by a probe, the reconciler or onceonly resolve. "
            "Do not run the operation again by hand"
        )
    else:
        what = "nothing was recorded and this call did not run the tool: call again once the store takes writes"
    raise type(exc)(
        f"the ledger refused {n + 1} writes for {key!r} (each time the record read back unchanged): {exc} — {what}"
    ) from exc


def _write(old: Record, new: Record, call: Call | None) -> Generator[Action, Any, tuple[bool, Record | None]]:
    """Compare-and-set ``old`` → ``new``. Returns (written, the record as it now is).

    If the store fails mid-write the write may or may not have landed: re-read, never guess. A write
    the store refused (the record read back unchanged) is the same write still to make: after
    ``_refused``'s pause it is sent again, until ``call``'s bound raises.
    """
    while True:
        try:
            ok = yield Swap(new, old)
            break
        except StoreError as exc:
            now_rec = yield Get(new.key)
            if landed(new, now_rec):
                return True, new
            if (
                call is None
                or now_rec is None
                or now_rec.version != old.version
                or now_rec.created_at != old.created_at
            ):
                return False, now_rec  # moved on (or gone, or made again): the caller decides from what is there
            yield from _refused(call, exc, new.key)
    if ok:
        if call is not None and call.refusals:
            call.refusals = 0  # the bound is on refusals in a row: the store takes writes again
        return True, new
    current = yield Get(new.key)
    return False, current
