"""The plan: a guarded call's decisions, as a generator of actions. No I/O: ``onceonly.drivers`` does it.

``plan()`` yields what it needs done (claim or read a record, compare-and-set one, run the tool, run
the probe, sleep, wait for a change) and receives each answer; it returns the ``Outcome`` or raises.
The sync driver and the async driver are two short loops over the same plan, so both have exactly
one semantics; the property test drives it from a scheduler of its own.

The shape of one call ("look" reads the record as it now is and goes by its state):

    claim ──new──▶ hold the lease ──▶ attempt ──result──▶ confirm ──▶ Outcome
      │ (similar=: under the group's lock)    │
      │                                       ├─not sent / not executed ──▶ failed, due after a backoff ──▶ look
      └─existing ──▶ look                     ├─definite failure ──▶ failed, re-raise
                                              ├─unknown, or timed out ──▶ unknown ──▶ look
                                              └─control flow, interrupt ──▶ given back / recorded, re-raise
    look
      ├─absent ──▶ insert ──▶ hold
      ├─other arguments ──▶ KeyConflict, or as below (on_conflict="replay")
      ├─confirmed ──▶ replay (past its ttl: claim again ──▶ hold)
      ├─held, lease live ──▶ wait for a change ──▶ look
      ├─held, lease gone ──▶ pending: claim again ──▶ hold; in flight: unknown ──▶ look
      ├─unknown ──▶ settle per on_unknown:
      │     review ──▶ needs_review, raise
      │     probe ──▶ found: confirm ──▶ Outcome; not found: claim again ──▶ hold
      │     resend | retry ──▶ after a backoff, claim again ──▶ hold (attempts used up: needs_review, raise)
      ├─failed ──▶ claim again once due ──▶ hold (attempts used up: abandoned, raise)
      ├─needs_review ──▶ raise
      └─abandoned ──▶ no attempt reached the other side: start afresh ──▶ hold; else raise

Modules: ``actions`` (what the plan yields and is answered, ``Call``, ``Outcome``), ``call``
(``plan()``: the loop over the record's states), ``states`` (one step per state), ``attempt``
(running the tool and recording what came of it), ``similar`` (the first claim of a tool with
``similar=``), ``late`` (an attempt's outcome that arrived after its caller stopped waiting),
``writes`` (compare-and-set, never guessing at a write whose answer was lost), ``texts`` (what the
errors say). Names with a leading underscore are shared inside this package only.
"""

from __future__ import annotations

from onceonly.plan.actions import (
    NOT_FOUND,
    Action,
    Call,
    Claim,
    Execute,
    Executed,
    Get,
    Insert,
    Outcome,
    Plan,
    Probe,
    Probed,
    Running,
    SimilarClaim,
    SimilarLock,
    SimilarUnlock,
    Sleep,
    Swap,
    WaitChange,
    encode_result,
    landed,
)
from onceonly.plan.call import plan
from onceonly.plan.late import late_outcome

__all__ = [
    "NOT_FOUND",
    "Action",
    "Call",
    "Claim",
    "Execute",
    "Executed",
    "Get",
    "Insert",
    "Outcome",
    "Plan",
    "Probe",
    "Probed",
    "Running",
    "SimilarClaim",
    "SimilarLock",
    "SimilarUnlock",
    "Sleep",
    "Swap",
    "WaitChange",
    "encode_result",
    "landed",
    "late_outcome",
    "plan",
]
