"""Connections to the Redis of several hosts' claims, and one bound on every call.

Every store in Redis (claims and registrations, snapshots, the load board)
reaches it through `connect_redis` and awaits each command with `call_redis`:
a stopped Redis (refused or reset connections) fails at once; one that hangs
fails once a call has taken its deadline in all, waiting for a pooled
connection included. Either is `ClaimsUnavailableError` (503
``claims_unavailable``); the client retries once at once (a pooled connection
may predate a Redis restart).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gym_sessions.errors import ClaimsUnavailableError

__all__ = ["STORE_DEADLINE_SECONDS", "call_redis", "connect_redis", "connect_redis_blocking"]

# A refused or reset connection fails at once; these bound a Redis that hangs.
# They are generous because a worker's event loop may lag by seconds under a
# burst, and a late reply is not a lost store. The deadline bounds a whole
# call (waiting for a pooled connection, connecting, the reply); the socket
# timeouts only back it up.
STORE_DEADLINE_SECONDS = 10.0
_CONNECT_TIMEOUT_SECONDS = 2.0
_REPLY_TIMEOUT_SECONDS = STORE_DEADLINE_SECONDS
_POOL_WAIT_SECONDS = STORE_DEADLINE_SECONDS
_MAX_CONNECTIONS = 64

_T = TypeVar("_T")


def connect_redis(url: str) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``url`` that fails fast when Redis is gone.

    Its pool is bounded and blocking: a burst of requests waits briefly for a
    connection instead of failing with "too many connections".
    """
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=_MAX_CONNECTIONS,
        timeout=_POOL_WAIT_SECONDS,
        socket_connect_timeout=_CONNECT_TIMEOUT_SECONDS,
        socket_timeout=_REPLY_TIMEOUT_SECONDS,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )
    return redis.asyncio.Redis.from_pool(pool)


def connect_redis_blocking(url: str) -> redis.Redis:
    """A blocking Redis client for ``url``, for the heartbeat thread (same timeouts)."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=_CONNECT_TIMEOUT_SECONDS,
        socket_timeout=_REPLY_TIMEOUT_SECONDS,
        decode_responses=True,
    )


# Calls given up at their deadline, kept referenced until they end (see call_redis).
_abandoned_calls: set[asyncio.Future[Any]] = set()


async def call_redis(operation: Awaitable[_T], deadline: float) -> _T:
    """Await a Redis call bounded by ``deadline`` seconds; failures are `ClaimsUnavailableError`.

    The call runs as a task of its own and the caller stops waiting at the
    deadline whatever the task does with its cancellation: redis-py 8.2 can
    hold a new connection's handshake past a cancel, which made a frozen
    Redis hang requests for as long as it stayed frozen.
    """
    call: asyncio.Future[_T] = asyncio.ensure_future(operation)
    try:
        done, _ = await asyncio.wait({call}, timeout=deadline)
    except asyncio.CancelledError:
        _abandon(call)
        raise
    if not done:
        _abandon(call)
        raise _no_answer(deadline)
    try:
        return call.result()
    except TimeoutError as exc:  # redis-py's own socket timeouts
        raise _no_answer(deadline) from exc
    except (redis.RedisError, OSError) as exc:
        # The type only: redis-py's text names the store's address (a socket path).
        raise ClaimsUnavailableError(
            f"the claim store is unreachable ({type(exc).__name__})"
        ) from exc


def _no_answer(deadline: float) -> ClaimsUnavailableError:
    return ClaimsUnavailableError(f"the claim store did not answer within {deadline:g} s")


def _abandon(call: asyncio.Future[Any]) -> None:
    """Cancel ``call`` without waiting for it; referenced until it ends (a pending
    task nothing refers to may be collected mid-run)."""
    call.cancel()
    _abandoned_calls.add(call)
    call.add_done_callback(_forget_abandoned_call)


def _forget_abandoned_call(call: asyncio.Future[Any]) -> None:
    _abandoned_calls.discard(call)
    if not call.cancelled():
        call.exception()  # retrieved: an abandoned call's failure is no one's to log
