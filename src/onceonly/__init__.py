"""onceonly: make the side-effecting tool calls of AI agents happen exactly once.

A timeout is not a failure: the outcome is unknown. onceonly settles every unknown with an
idempotency key or by asking the other side, never by guessing.

    import onceonly

    ledger = onceonly.Ledger.open("sqlite:///onceonly.db")

    @ledger.tool(key=("session_id", "title"), on_unknown="probe", probe=find_ticket)
    def create_ticket(session_id: str, title: str, body: str, *, idempotency_key: str) -> dict: ...
"""

from __future__ import annotations

from onceonly.budgets import Budget
from onceonly.dryrun import DryRun, DryRunLog
from onceonly.errors import (
    ApprovalDenied,
    ApprovalPending,
    AttemptsExhausted,
    BudgetExceeded,
    InProgress,
    InvalidKey,
    KeyConflict,
    NotSerializable,
    OnceOnlyError,
    OutcomeUnknown,
    Paused,
    ReentrantCall,
    Refused,
    RetryScheduled,
    SimilarCall,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)
from onceonly.events import TransitionEvent
from onceonly.keys import canonical_json, normalize_number, normalize_text, normalize_whitespace
from onceonly.ledger import CallInfo, Ledger, amark_sent, current_call, mark_sent
from onceonly.pause import Pause
from onceonly.plan import NOT_FOUND, Outcome
from onceonly.policy import Classification, Retry, Verdict, classify, conflict_classifier
from onceonly.similar import Similar
from onceonly.states import Record, State
from onceonly.stores import Query, Store, open_store
from onceonly.tell import tell_model
from onceonly.tools import AsyncTool, Tool, ToolSpec

__version__ = "0.1.0"

__all__ = [
    "NOT_FOUND",
    "ApprovalDenied",
    "ApprovalPending",
    "AsyncTool",
    "AttemptsExhausted",
    "Budget",
    "BudgetExceeded",
    "CallInfo",
    "Classification",
    "DryRun",
    "DryRunLog",
    "InProgress",
    "InvalidKey",
    "KeyConflict",
    "Ledger",
    "NotSerializable",
    "OnceOnlyError",
    "Outcome",
    "OutcomeUnknown",
    "Pause",
    "Paused",
    "Query",
    "Record",
    "ReentrantCall",
    "Refused",
    "Retry",
    "RetryScheduled",
    "Similar",
    "SimilarCall",
    "State",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "Tool",
    "ToolSpec",
    "TransitionEvent",
    "Verdict",
    "__version__",
    "amark_sent",
    "canonical_json",
    "classify",
    "conflict_classifier",
    "current_call",
    "mark_sent",
    "normalize_number",
    "normalize_text",
    "normalize_whitespace",
    "open_store",
    "tell_model",
]
