"""Near-duplicate calls (``onceonly.Similar``): a group's lock, its members and their arguments, in the
group's own slot."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from onceonly.similar import Candidate
from onceonly.states import Record
from onceonly.stores.redis._layout import log
from onceonly.stores.redis._plans import one
from onceonly.stores.redis._scripts import SIMILAR_FILE, SIMILAR_LOCK, SIMILAR_UNLOCK

T = TypeVar("T")

#: How long a group's keys last when a claim is filed after its lock ran out (the window is unknown
#: then): a day, longer than any window one would choose.
_FILED_MS = 86_400_000


def _lost(filed: Any, got: Record | None, key: str) -> None:
    """Say so when a claim was filed after its group's lock ran out: a similar call that looked at the
    group meanwhile did not see it (the claim took longer than the lock, onceonly.plan.similar.SIMILAR_LOCK_SECONDS)."""
    if got is None and filed != 1:
        log.warning(
            "onceonly %s: claimed after its similar-calls lock ran out; a similar call made meanwhile may have "
            "run too (check its group for a near-duplicate)",
            key,
        )


def _candidates(found: Any) -> list[Candidate] | None:
    if found is None:
        return None
    text = [x.decode() if isinstance(x, bytes) else str(x) for x in found]
    return [Candidate(text[i], float(text[i + 1]), text[i + 2]) for i in range(0, len(text), 3)]


class SimilarCalls:
    """``RedisStore``'s ``similar_*`` primitives (``onceonly.stores.base.SimilarStore``)."""

    if TYPE_CHECKING:  # the store's
        _tags: list[str]

        def _shard(self, key: str) -> int: ...
        def _run(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T: ...
        async def _arun(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T: ...
        def claim(self, record: Record) -> Record | None: ...
        async def aclaim(self, record: Record) -> Record | None: ...

    def _group_keys(self, group: str) -> tuple[str, str, str]:
        """The lock, members and arguments of ``group``: one hash slot, the shard of the group's name."""
        tag = self._tags[self._shard(group)]
        return f"{tag}:gl:{group}", f"{tag}:gs:{group}", f"{tag}:ga:{group}"

    def _similar_lock_command(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> tuple[Any, ...]:
        life_ms = max(1, int((until - now) * 1000))
        window_ms = max(1, int((now - since) * 1000))
        return ("EVAL", SIMILAR_LOCK, 3, *self._group_keys(group), token, life_ms, repr(since), limit, window_ms)

    def _similar_file_command(
        self, record: Record, group: str, token: str, *, keep_lock: bool = False
    ) -> tuple[Any, ...]:
        keys = self._group_keys(group)
        keep = _FILED_MS  # how long the group lasts when the lock (which carries the window) ran out
        args = (token, record.key, repr(record.created_at), record.args_json, keep, "keep" if keep_lock else "free")
        return ("EVAL", SIMILAR_FILE, 3, *keys, *args)

    def _after_claim(self, record: Record, group: str, token: str, got: Record | None) -> tuple[Any, ...]:
        """File a record this call claimed and free the lock; only free it when the key was taken."""
        return self._similar_file_command(record, group, token) if got is None else self._unlock_command(group, token)

    def _unlock_command(self, group: str, token: str) -> tuple[Any, ...]:
        return ("EVAL", SIMILAR_UNLOCK, 1, self._group_keys(group)[0], token)

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        command = self._similar_lock_command(group, token, now, until, since, limit)
        return _candidates(self._run(one(command), f"looking up calls similar to group {group!r}"))

    def similar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        # The record's slot and the group's differ: claim first, under the lock, then file and free.
        got = self.claim(record)
        command = self._after_claim(record, group, token, got)
        _lost(self._run(one(command), f"filing {record.key!r}"), got, record.key)
        return got

    def similar_unlock(self, group: str, token: str) -> None:
        self._run(one(self._unlock_command(group, token)), f"freeing the group {group!r}")

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        command = self._similar_lock_command(group, token, now, until, since, limit)
        return _candidates(await self._arun(one(command), f"looking up calls similar to group {group!r}"))

    async def asimilar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        got = await self.aclaim(record)
        command = self._after_claim(record, group, token, got)
        _lost(await self._arun(one(command), f"filing {record.key!r}"), got, record.key)
        return got

    async def asimilar_unlock(self, group: str, token: str) -> None:
        await self._arun(one(self._unlock_command(group, token)), f"freeing the group {group!r}")
