"""The outcome of an attempt that arrived after its caller stopped waiting (a timeout, a cancelled caller).

Driven apart from the call's own plan (``onceonly.drivers``: the late result of a timed-out attempt).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from onceonly import states as st
from onceonly.errors import StoreError
from onceonly.plan.actions import Action, Call, Get, Sleep, encode_result, log
from onceonly.plan.texts import _err_text
from onceonly.plan.writes import _write
from onceonly.policy import Verdict, classify
from onceonly.states import HELD, Record, State

__all__ = ["late_outcome"]


#: Pauses before reading again when recording a late outcome meets a store error (about 3 s in all).
_LATE_RETRY_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6)


def late_outcome(
    call: Call, fence: int, value: Any = None, error: BaseException | None = None
) -> Generator[Action, Any, Record | None]:
    """The outcome of attempt ``fence`` that arrived after its caller stopped waiting (a timeout, a
    cancelled caller). A success is never dropped: it confirms the record, or is counted as a
    conflict on a record settled otherwise. A definite failure settles the record only while it is
    still the unknown of that very attempt. The attempt is ``fence`` of the record ``call`` last ran
    an attempt on (``call.created_at``): on a record made again since, it is another record's.

    .. versionadded:: 0.1
    """
    result_json = None if error is not None else encode_result(value, call.key)
    failures = 0
    while True:
        try:
            rec: Record | None = yield Get(call.key)
            if rec is None:
                log.warning("onceonly %s: late outcome of attempt %d for a record that is gone", call.key, fence)
                return None
            now = call.clock()
            if error is None:
                new = st.late_success(
                    rec, fence=fence, result_json=result_json, now=now, ttl=call.policy.ttl, by=call.owner,
                    created_at=call.created_at,
                )  # fmt: skip
                if new is rec:
                    return rec
            else:
                verdict = classify(error, call.policy.classify)
                same_attempt = (
                    rec.fence == fence
                    and rec.state in (State.UNKNOWN, *HELD)
                    and (call.created_at is None or rec.created_at == call.created_at)
                )
                if verdict.verdict is Verdict.UNKNOWN or not same_attempt:
                    return rec
                new = st.fail(rec, error=_err_text(error), now=now, retry_at=None, ttl=call.policy.ttl, by=call.owner)
            # _write tells a write whose answer was lost but that landed from one that did not: read
            # afresh, this late outcome would be taken for another attempt's (a counted duplicate).
            ok, _ = yield from _write(rec, new, call)
        except StoreError:
            # A store down for a moment (the read, or the write and the read after it): read again.
            failures += 1
            if failures > len(_LATE_RETRY_DELAYS):
                raise
            yield Sleep(_LATE_RETRY_DELAYS[failures - 1])
            continue
        if ok:
            return new
