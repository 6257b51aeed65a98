"""Claims and worker addresses in Redis, for workers on several hosts (``claims = "redis://..."``).

Keys, under one prefix per Redis database:

- ``gym_sessions:claim:<sha256 of the session id>`` = the claimant's worker
  id. Created with ``SET NX`` (two workers never both hold an id); only the
  claimant changes or removes it, and every change compares the value first
  (a script), so a late removal can never delete another worker's claim. No
  expiry while the session is open or a request for it is in flight; the
  claimant gives it one (its window plus a margin) when it goes idle and not
  open (`OwnedClaims`).
- ``gym_sessions:worker:<worker id>`` = ``host:port`` of the worker's private
  TCP listener, with a short expiry the worker's heartbeat keeps renewing. A
  claim whose worker has no registration belongs to a dead (or cut-off)
  worker: its requests get 410, and the reader gives the orphaned claim an
  expiry so it does not stay in Redis forever.

Reading a claim and its worker's address is one round trip (a script). Redis
errors become `ClaimsUnavailableError` (503 ``claims_unavailable``); the
client retries once at once (a pooled connection may predate a Redis restart)
and otherwise fails fast, so a request never waits long on a lost Redis.
The scripts read a key they are not given (the worker registration), which is
fine on one Redis server or a replicated pair, not on Redis Cluster.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gym_sessions.errors import ClaimsUnavailableError, StartupError
from gym_sessions.routing.claim_store import claim_name

__all__ = [
    "REDIS_SCHEMES",
    "RedisClaimStore",
    "WorkerRegistry",
    "check_redis",
    "connect_redis",
    "is_redis_url",
]

logger = logging.getLogger("gym_sessions.routing")

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
KEY_PREFIX = "gym_sessions:"
# A worker's registration lives this long without a heartbeat; heartbeats come
# a few times per period, so one slow Redis reply does not unregister a worker.
REGISTRATION_SECONDS = 10.0
HEARTBEAT_SECONDS = 2.0
# Look for dead workers' forgotten claims about every 30 s (on each worker).
REAP_EVERY_BEATS = 15
_CONNECT_TIMEOUT_SECONDS = 1.0
_REPLY_TIMEOUT_SECONDS = 2.0
_ADDRESS_CACHE_SIZE = 4096
_MAX_CONNECTIONS = 32

_T = TypeVar("_T")

# Every claim script gets KEYS = [claim key, this worker's claim index] and
# ARGV = [worker id, claim name, ...]. The index (a set of claim names per
# worker) lets the reaper find a dead worker's claims that nobody asks about.

# Claim unless claimed; reply the holder if claimed (our own id included).
_CREATE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('SADD', KEYS[2], ARGV[2])
  return false
end
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then redis.call('SADD', KEYS[2], ARGV[2]) end
return owner
"""
# The claimant of KEYS[1] and its registered address (ARGV[1] is the
# registration key prefix). An orphaned claim (no registration) gets an expiry
# of ARGV[2] ms unless it has one.
_READ = """
local owner = redis.call('GET', KEYS[1])
if not owner then return false end
local address = redis.call('GET', ARGV[1] .. owner)
if address then return {owner, address} end
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {owner}
"""
_REMOVE = """
redis.call('SREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Keep our claim without expiry; write it again if it expired meanwhile.
_HOLD = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then redis.call('PERSIST', KEYS[1]) return 1 end
if owner then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""
_EXPIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 0
"""
# KEYS = [a worker's claim index, its registration]; ARGV = [its id, orphan ms,
# claim key prefix]. If the worker is unregistered, give each of its claims
# without expiry the orphan expiry, and drop the index.
_REAP = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local reaped = 0
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[3] .. name
  if redis.call('GET', key) == ARGV[1] and redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, ARGV[2])
    reaped = reaped + 1
  end
end
redis.call('DEL', KEYS[1])
return reaped
"""


def is_redis_url(claims: str) -> bool:
    """Whether the ``claims`` setting names a Redis server."""
    return claims.startswith(REDIS_SCHEMES)


def connect_redis(url: str) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``url`` that fails fast when Redis is gone.

    Its pool is bounded and blocking: a burst of requests waits briefly for a
    connection instead of failing with "too many connections".
    """
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=_MAX_CONNECTIONS,
        timeout=_REPLY_TIMEOUT_SECONDS,
        socket_connect_timeout=_CONNECT_TIMEOUT_SECONDS,
        socket_timeout=_REPLY_TIMEOUT_SECONDS,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )
    return redis.asyncio.Redis.from_pool(pool)


def check_redis(url: str) -> None:
    """Fail start-up with one clear line if Redis at ``url`` does not answer.

    Raises:
        StartupError: Redis is unreachable or refuses us.
    """
    client = redis.Redis.from_url(
        url, socket_connect_timeout=2.0, socket_timeout=2.0, decode_responses=True
    )
    try:
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise StartupError(f"cannot reach the claim store at {url}: {exc}") from exc
    finally:
        client.close()


async def _call(operation: Awaitable[_T]) -> _T:
    try:
        return await operation
    except (redis.RedisError, OSError) as exc:
        raise ClaimsUnavailableError(f"the claim store is unreachable: {exc}") from exc


class WorkerRegistry:
    """Worker addresses in Redis: this worker's registration and a cache of the others'.

    Args:
        client: The worker's Redis client.
        worker_id: This worker's id.
    """

    def __init__(self, client: redis.asyncio.Redis, worker_id: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.key_prefix = KEY_PREFIX + "worker:"
        self.address: str | None = None
        # Worker id -> (host, port). An id's address never changes; whether the
        # worker lives is asked again whenever a claim is read.
        self._known: dict[str, tuple[str, int]] = {}

    def remember(self, worker_id: str, address: str | None) -> None:
        """Record what a claim read said about ``worker_id`` (``None``: not registered)."""
        if address is None:
            self._known.pop(worker_id, None)
            return
        if worker_id not in self._known:
            if len(self._known) >= _ADDRESS_CACHE_SIZE:
                self._known.clear()
            self._known[worker_id] = _split_address(address)

    async def lookup(self, worker_id: str) -> tuple[str, int] | None:
        """The private address of ``worker_id``, or ``None`` if it is not registered."""
        known = self._known.get(worker_id)
        if known is not None:
            return known
        address = await _call(self.client.get(self.key_prefix + worker_id))
        self.remember(worker_id, address)
        return self._known.get(worker_id)

    async def register(self, host: str, port: int) -> None:
        """Register this worker's private address (replaces an earlier registration)."""
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        await _call(
            self.client.set(
                self.key_prefix + self.worker_id, self.address, px=int(REGISTRATION_SECONDS * 1000)
            )
        )

    async def renew(self) -> bool:
        """Renew the registration; ``False`` if it had lapsed and was written afresh."""
        assert self.address is not None
        key, ttl = self.key_prefix + self.worker_id, int(REGISTRATION_SECONDS * 1000)
        if await _call(self.client.set(key, self.address, px=ttl, xx=True)):
            return True
        await _call(self.client.set(key, self.address, px=ttl))
        return False

    async def unregister(self) -> None:
        """Remove this worker's registration: its sessions get 410 at once."""
        await _call(self.client.delete(self.key_prefix + self.worker_id))

    async def run_heartbeat(
        self,
        on_lapse: Callable[[], Awaitable[object]],
        reap: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Renew until cancelled.

        After a lapse (Redis lost its data, or was unreachable past the
        registration's expiry) call ``on_lapse``; every `REAP_EVERY_BEATS`
        beats (from a random first beat, so workers take turns) call ``reap``.
        """
        restore_pending = False
        beat = secrets.randbelow(REAP_EVERY_BEATS)
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            beat += 1
            try:
                if not await self.renew() or restore_pending:
                    restore_pending = True
                    await on_lapse()
                    restore_pending = False
                if reap is not None and beat % REAP_EVERY_BEATS == 0:
                    await reap()
            except ClaimsUnavailableError as exc:
                logger.warning("worker %s: claim store unreachable: %s", self.worker_id, exc)
            except Exception:
                logger.exception("worker %s: heartbeat failed", self.worker_id)


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class RedisClaimStore:
    """`ClaimStore` on Redis, shared by every worker of every host.

    Args:
        client: The worker's Redis client.
        registry: Worker registrations (filled with what claim reads learn).
        orphan_seconds: How long a dead worker's claim keeps answering 410
            after a reader first finds it (the server's window plus a margin).
    """

    expires = True

    def __init__(
        self, client: redis.asyncio.Redis, registry: WorkerRegistry, orphan_seconds: float
    ) -> None:
        self.client = client
        self.registry = registry
        self.worker_id = registry.worker_id
        self._create = client.register_script(_CREATE)
        self._read = client.register_script(_READ)
        self._remove = client.register_script(_REMOVE)
        self._hold = client.register_script(_HOLD)
        self._expire = client.register_script(_EXPIRE)
        self._reap = client.register_script(_REAP)
        self.orphan_ms = max(1, int(orphan_seconds * 1000))
        self.index_key = self.index_prefix + self.worker_id

    claim_prefix = KEY_PREFIX + "claim:"
    index_prefix = KEY_PREFIX + "claims_of:"

    @classmethod
    def key(cls, session_id: str) -> str:
        """The Redis key of a session's claim."""
        return cls.claim_prefix + claim_name(session_id)

    def _run(self, script: Any, session_id: str, *extra: object) -> Awaitable[Any]:
        name = claim_name(session_id)
        return _call(
            script(
                keys=[self.claim_prefix + name, self.index_key],
                args=[self.worker_id, name, *extra],
            )
        )

    async def create(self, session_id: str) -> str | None:
        return await self._run(self._create, session_id)

    async def read(self, session_id: str) -> str | None:
        found: Any = await _call(
            self._read(
                keys=[self.key(session_id)],
                args=[self.registry.key_prefix, self.orphan_ms],
            )
        )
        if not found:
            return None
        owner = found[0]
        self.registry.remember(owner, found[1] if len(found) > 1 else None)
        return owner

    async def remove(self, session_id: str) -> None:
        await self._run(self._remove, session_id)

    async def hold(self, session_id: str) -> bool:
        return bool(await self._run(self._hold, session_id))

    async def expire(self, session_id: str, seconds: float) -> None:
        await self._run(self._expire, session_id, max(1, int(seconds * 1000)))

    async def reap_orphans(self) -> int:
        """Give the claims of unregistered workers an expiry; returns how many.

        A reader already does this for a claim it finds; this finds the ones
        nobody asks about (sessions that were open when their worker died),
        so Redis does not keep them forever.
        """
        try:
            index_keys = [
                key async for key in self.client.scan_iter(match=self.index_prefix + "*", count=200)
            ]
        except (redis.RedisError, OSError) as exc:
            raise ClaimsUnavailableError(f"the claim store is unreachable: {exc}") from exc
        reaped = 0
        for index_key in index_keys:
            worker_id = index_key[len(self.index_prefix) :]
            if worker_id == self.worker_id:
                continue
            found = await _call(
                self._reap(
                    keys=[index_key, self.registry.key_prefix + worker_id],
                    args=[worker_id, self.orphan_ms, self.claim_prefix],
                )
            )
            reaped += max(0, int(found))
        return reaped

    async def close(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()
