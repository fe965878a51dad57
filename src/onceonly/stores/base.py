"""The store contract: a few atomic primitives over records. Policy lives in the ledger, not here.

Every store offers the same operations twice, sync and async (``aget``…), with the same semantics,
proven by one conformance suite (``tests/stores/``):

- ``get(key)``: the record, or ``None``.
- ``claim(record)``: write it only if the key is absent and return ``None`` (the caller now holds
  it); else return the stored record, unchanged. The first action of every guarded call, and first
  calls are the rule: keep that case cheap. Redis does it all in one round trip (a Lua script); the
  SQL stores insert first and read only on a conflict, so a first call is just the two writes of
  claim and settle, and a replay pays a second statement.
- ``insert(record)``: write it only if the key is absent; ``True`` when this call wrote it.
  ``insert`` and ``swap`` write the record as given, every field, its history and version as they
  are: ``onceonly.transfer`` copies ledgers between stores through them alone.
- ``swap(record, expected)``: replace the record only if its stored ``version`` is still
  ``expected.version`` and its ``created_at`` is still ``expected.created_at``: the compare-and-set
  every transition goes through. ``expected`` is the record as the caller read it, so a store may
  write only the fields that differ. The version alone is not enough: a record lost from the store
  (a restart without persistence, a failover to a lagging replica) and made again by another caller
  starts again at version 1, and a caller still holding the lost one must not write over it.
  ``created_at`` names the incarnation: it is set when a record is made and never changes.
- ``delete(key, expected_version, created_at=None)``: remove it only at that version, and (given)
  only that incarnation (purge).
- ``scan(...)``: records by state, tool, scope and due time, in key order, paged by ``after``.
- ``wait_for_change(key, version, timeout)``: return when the record may have changed, or after
  ``timeout``; a store without notifications just sleeps.
Tools with ``similar=`` need three more, in ``SimilarStore`` / ``AsyncSimilarStore``:

- ``similar_lock(group, token, now, until, since, limit)``: take the lock of a group of near-duplicate
  calls (``onceonly.Similar``) for ``token`` until ``until`` (free, held by ``token`` already, or held
  past its time at ``now``), then return the group's candidates claimed at or after ``since``, newest
  first, at most ``limit``; ``None`` (nothing read) while another token holds the lock. Read through
  an index of the group (SQL: a table and its index; Redis: a sorted set per group), never a scan.
  A group lives in one hash slot of its own on Redis Cluster.
- ``similar_claim(record, group, token)``: ``claim`` that also files the record in ``group`` (only
  when it made the record) and frees the lock, in one step and only while ``token`` holds the lock
  (else ``False``, nothing written). A store whose record and group cannot be written in one step
  (Redis: two hash slots) claims while the lock is held and files after; it never answers ``False``.
  Filed records leave their group with the record (purge), or, on Redis, once older than the window.
- ``similar_unlock(group, token)``: free the lock if ``token`` holds it.
  Only tools with ``similar=`` call these three: the other tools' calls cost what they did.
Tools with ``budget=`` (``onceonly.Budget``) need three more, in ``BudgetStore`` (sync only: an async
tool calls them in a worker thread):

- ``budget_reserve(budget, window, key, amount, limit, start, until)``: add ``amount`` to the window's
  total for operation ``key`` only if the total stays within ``limit``, checked and recorded in one
  atomic step (one Lua script on one Redis key, one transaction in SQL). Idempotent per key within a
  window: a key the window holds already is granted again, not counted twice. Returns a
  ``Reservation`` (granted, the window's total, whether this call added it).
- ``budget_release(key)``: free whatever ``key`` holds, in any window (the store keeps key → windows,
  so a caller that knows only the key can release it); ``True`` when something was freed.
- ``budget_usage(now)``: the windows of every budget that are current at ``now`` (``BudgetUse``).
  Windows that ended are dropped by the store (expiry on Redis, on the next window's first call in SQL).
- ``lease_survey(now, full_every)`` (optional, not part of the protocol): a store that cannot find
  held records with an expired lease without reading every record (SQLite) says whether any can
  have run out by ``now``; a reconcile pass then reads them only when one can
  (``onceonly.stores._holders.Survey``). Stores with an index of held records (Redis, PostgreSQL)
  leave it out and are read through the index on every pass.
- ``time()`` (optional, not part of the protocol): the store's own clock in seconds since the epoch,
  one round trip. A store that has one offers it (Redis ``TIME``, PostgreSQL ``clock_timestamp()``), and
  the ledger then reads leases and due times on it (``onceonly.clock``), so hosts whose clocks differ
  agree. A store without it (SQLite: one host, one clock) leaves the ledger on the host's clock.

- ``controls(namespace)``, ``put_control(namespace, name, doc)``, ``delete_control(namespace, name)``
  (optional, ``ControlStore``; ``acontrols`` in ``AsyncControlStore``): small JSON documents an operator
  sets for every process that shares the store, by namespace and name (``onceonly.pause`` keeps its
  pauses in namespace ``"pause"``). ``controls`` reads a whole namespace in one round trip: a ledger reads
  it at most every half second, never per call. All three stores of onceonly have them.

Driver errors are translated at this boundary: ``StoreUnavailable`` when the store could not be
reached (whether the write landed is then unknown: the ledger re-reads), ``StoreCorrupt`` for data
that is not a ledger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol, runtime_checkable

from onceonly.errors import InvalidKey
from onceonly.similar import Candidate
from onceonly.states import Record, State

if TYPE_CHECKING:
    from onceonly.stores._holders import Survey

__all__ = [
    "AsyncControlStore",
    "AsyncSimilarStore",
    "AsyncStore",
    "BudgetStore",
    "BudgetUse",
    "Candidate",
    "ClockedStore",
    "ControlStore",
    "InlineStore",
    "Query",
    "Reservation",
    "SimilarStore",
    "Store",
    "SurveyingStore",
]


@dataclass(frozen=True, slots=True)
class Query:
    """What ``scan`` returns: every given condition must hold.

    Args:
        states: only these states (``None``: all).
        tool: only this tool.
        scope: only this scope.
        lease_expired_before: only held records whose lease ended before this time, plus records of
            the other given states (the reconciler's query: unknown, or in flight and abandoned).
        expires_before: only records whose ``expires_at`` is before this time (purge).
        after: only keys greater than this (paging).
        limit: at most this many.
    """

    states: Sequence[State] | None = None
    tool: str | None = None
    scope: str | None = None
    lease_expired_before: float | None = None
    expires_before: float | None = None
    after: str | None = None
    limit: int = 100

    def __post_init__(self) -> None:
        # A name typed at the CLI or sent by a dashboard reaches every store's driver as it is, and
        # text with a NUL or without a UTF-8 form fails there each its own way (UnicodeEncodeError in
        # sqlite3 and psycopg, a DataError PostgreSQL reports). No key, tool or scope can hold such
        # text (``keys.validate_name``), so it is refused here, once, for every store alike.
        for field in ("tool", "scope", "after"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidKey(f"{field}={value!r:.80}: give a str, as `onceonly ls` shows it, or None")
            if "\x00" in value or (not value.isascii() and _lone_surrogate(value)):
                raise InvalidKey(
                    f"{field}={value[:60]!r}: holds a NUL or a lone surrogate, which no key, tool or scope can "
                    f"hold: give the {field} as `onceonly ls` shows it"
                )


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@runtime_checkable
class Store(Protocol):
    """A ledger store, sync face.

    .. versionadded:: 0.1
    """

    url: str

    def get(self, key: str) -> Record | None: ...

    def claim(self, record: Record) -> Record | None: ...

    def insert(self, record: Record) -> bool: ...

    def swap(self, record: Record, expected: Record) -> bool: ...

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool: ...

    def scan(self, query: Query) -> list[Record]: ...

    def count_by_state(self) -> dict[State, int]: ...

    def wait_for_change(self, key: str, version: int, timeout: float) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncStore(Protocol):
    """A ledger store, async face: the same operations as ``Store``, awaited.

    .. versionadded:: 0.1
    """

    url: str

    async def aget(self, key: str) -> Record | None: ...

    async def aclaim(self, record: Record) -> Record | None: ...

    async def ainsert(self, record: Record) -> bool: ...

    async def aswap(self, record: Record, expected: Record) -> bool: ...

    async def adelete(self, key: str, expected_version: int, created_at: float | None = None) -> bool: ...

    async def ascan(self, query: Query) -> list[Record]: ...

    async def await_for_change(self, key: str, version: int, timeout: float) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SimilarStore(Protocol):
    """The primitives of near-duplicate calls (``onceonly.Similar``), sync face: a store that offers them
    guards tools with ``similar=``. Apart from ``Store`` so that a store of one's own needs them only
    for such tools. All three stores of onceonly have them, and ``AsyncSimilarStore``.

    .. versionadded:: 0.1
    """

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None: ...

    def similar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None: ...

    def similar_unlock(self, group: str, token: str) -> None: ...


@runtime_checkable
class AsyncSimilarStore(Protocol):
    """``SimilarStore``, awaited.

    .. versionadded:: 0.1
    """

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None: ...

    async def asimilar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None: ...

    async def asimilar_unlock(self, group: str, token: str) -> None: ...


class Reservation(NamedTuple):
    """What ``BudgetStore.budget_reserve`` answers.

    Attributes:
        granted: the amount is held for the key (now, or already before).
        used: the window's total: with this amount when granted, without it when refused.
        new: this call added the amount (``False``: refused, or the key held it already).

    .. versionadded:: 0.1
    """

    granted: bool
    used: float
    new: bool


class BudgetUse(NamedTuple):
    """One budget's current window, as ``BudgetStore.budget_usage`` lists it.

    .. versionadded:: 0.1
    """

    budget: str
    start: float
    until: float
    used: float
    limit: float


@runtime_checkable
class BudgetStore(Protocol):
    """The primitives of budgets (``onceonly.Budget``): a store that offers them guards tools with
    ``budget=``. All three stores of onceonly have them.

    .. versionadded:: 0.1
    """

    def budget_reserve(
        self, budget: str, window: int, key: str, amount: float, limit: float, start: float, until: float
    ) -> Reservation: ...

    def budget_release(self, key: str) -> bool: ...

    def budget_usage(self, now: float) -> list[BudgetUse]: ...


@runtime_checkable
class ControlStore(Protocol):
    """Operators' control documents, shared by every process on the store: small JSON objects by
    namespace and name (``onceonly.pause``: namespace ``"pause"``). A namespace is read whole, in one
    round trip; a write replaces one document, a delete removes one (``True`` when it was there).
    Optional: a ledger over a store without it cannot be paused.

    .. versionadded:: 0.1
    """

    def controls(self, namespace: str) -> dict[str, dict[str, Any]]: ...

    def put_control(self, namespace: str, name: str, doc: Mapping[str, Any]) -> None: ...

    def delete_control(self, namespace: str, name: str) -> bool: ...


@runtime_checkable
class AsyncControlStore(Protocol):
    """``ControlStore``'s read, awaited (what an async guarded call makes when its pauses are due).

    .. versionadded:: 0.1
    """

    async def acontrols(self, namespace: str) -> dict[str, dict[str, Any]]: ...


@runtime_checkable
class ClockedStore(Protocol):
    """A store with a clock of its own (Redis, PostgreSQL): the ledger reads leases, due times and settle
    times on it, so that hosts whose clocks differ agree (``onceonly.clock``). Optional: a store without
    one (SQLite, on one host) is read on this host's clock.

    .. versionadded:: 0.1
    """

    def time(self) -> float: ...


@runtime_checkable
class SurveyingStore(Protocol):
    """A store that knows who holds its leases (SQLite, through its holders' files): a reconcile pass
    asks it whether any lease can have run out, and reads only the unknown records when none can.
    Optional: without it, every pass reads the held records too.

    .. versionadded:: 0.1
    """

    def lease_survey(self, now: float, full_every: float | None) -> Survey: ...


@runtime_checkable
class InlineStore(Protocol):
    """A store that may be called on an event loop itself (SQLite without an fsync per commit: a write
    takes microseconds), as long as no call waits there on a lock held elsewhere. The HTTP middleware's
    ``store_calls="inline"`` uses it. Optional.

    .. versionadded:: 0.1
    """

    closed: bool

    def writes_inline(self) -> bool:
        """Whether a write is fast enough to make on the loop (no fsync per commit)."""
        ...

    def nowait(self) -> Store:
        """A new store over the same data whose calls never wait on a lock: one that would fails at once,
        and ``is_busy`` says so (it wrote nothing). The caller closes it."""
        ...

    def is_busy(self, exc: BaseException) -> bool:
        """Whether ``exc`` failed a call only because another connection held the lock."""
        ...
