"""What every part of the Redis store shares: the schema version, the defaults, the states as stored,
and which of redis-py's exceptions count as a failed command."""

from __future__ import annotations

import contextvars
import logging

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from onceonly.states import State

# The package's name, which the docs name: the store logs there whichever of its modules speaks.
log = logging.getLogger("onceonly.stores.redis")

#: Version of the key layout and record encoding; kept in ``P:meta``.
SCHEMA_VERSION = 1
DEFAULT_PREFIX = "onceonly"
DEFAULT_SHARDS = 16
MAX_SHARDS = 4096

STATES = {s.value: s for s in State}
VALUE = {s: s.value for s in State}  # Enum.value is a descriptor call: precomputed for the hot path
OPEN = frozenset({State.UNKNOWN, State.NEEDS_REVIEW})
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)
# What a failed command raises: redis-py's cluster client raises some of its own (no node reachable,
# a slot no node serves) outside RedisError.
FAILURES = (RedisError, RedisClusterException)

#: The store (its ``id``) whose last write in this thread or task was not acknowledged by its replicas:
#: its next read there must prove what it reads is on them too (``RedisStore.get``). A context variable,
#: so that a doubt follows the call that raised it (a thread, an asyncio task), not the connection.
DOUBT: contextvars.ContextVar[int] = contextvars.ContextVar("onceonly_redis_doubt", default=0)
