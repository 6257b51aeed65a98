"""Claims and worker addresses in Redis, for workers on several hosts (``claims = "redis://..."``).

Keys, under one prefix per Redis database:

- ``gym_sessions:claim:<sha256 of the session id>`` = ``<worker id>|<its private
  address>|<MAC>``: the claimant and where it listens. Created with ``SET NX``
  (two workers never both hold an id); only the
  claimant changes or removes it, and every change compares the value first
  (a script), so a late removal can never delete another worker's claim. No
  expiry while the session is open or a request for it is in flight; the
  claimant gives it one (its window plus a margin) when it goes idle and not
  open (`OwnedClaims`).
- ``gym_sessions:claims_of:<worker id>`` = the claim names a worker holds,
  and ``gym_sessions:indexed_workers`` = the workers with such an index: how
  the reaper finds a dead worker's claims that nobody asks about.
- ``gym_sessions:worker:<worker id>`` = ``host:port|<MAC>`` of the worker's
  private TCP listener, with a short expiry the worker's heartbeat keeps renewing. A
  claim whose worker has no registration belongs to a dead (or cut-off)
  worker: its requests get 410, and the reader (or the reaper) gives the
  orphaned claim an expiry so it does not stay in Redis forever.
- ``gym_sessions:epoch`` = one lifetime of Redis's data. When a running worker
  finds it gone (Redis came back empty), it creates it stamped with Redis's
  clock and writes its claims back; for `RESTORE_GRACE_SECONDS` after that a
  claim miss is "no answer" (503), so a session is never taken over by another
  worker before its claimant has written it back.

Redis is not trusted for integrity: claim and registration values carry an
HMAC-SHA256 (key derived from the server secret for this purpose, truncated to
128 bits) over the claim name or worker id and the rest of the value. A value
that does not verify is treated as missing and answered 503 (never forwarded
to), so whoever can write Redis without the secret can deny service but cannot
receive a forwarded request or feed a client.

Reading a claim and its worker's address is one round trip (a script). Redis
errors become `ClaimsUnavailableError` (503 ``claims_unavailable``); the
client retries once at once (a pooled connection may predate a Redis restart).
A stopped Redis (refused or reset connections) fails at once; one that hangs
fails once a call has taken `STORE_DEADLINE_SECONDS` (10 s) in all, waiting for
a pooled connection included: long enough that a worker's own lag under a
burst is never taken for a lost Redis (the stress run found that), and one
bound, not a pool wait plus a reply timeout one after the other.
The scripts read a key they are not given (the worker registration), which is
fine on one Redis server or a replicated pair, not on Redis Cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gym_sessions.errors import ClaimsUnavailableError, StartupError
from gym_sessions.routing.claim_store import claim_name

__all__ = [
    "REGISTRATION_PREFIX",
    "STORE_DEADLINE_SECONDS",
    "EntrySigner",
    "RedisClaimStore",
    "WorkerRegistry",
    "check_redis",
    "connect_redis",
    "connect_redis_blocking",
]

logger = logging.getLogger("gym_sessions.routing")

KEY_PREFIX = "gym_sessions:"
# A worker's registration lives this long without a heartbeat; heartbeats come
# a few times per period, so one slow Redis reply does not unregister a worker.
REGISTRATION_SECONDS = 10.0
HEARTBEAT_SECONDS = 2.0
# Look for dead workers' forgotten claims about every 30 s (on each worker).
REAP_EVERY_BEATS = 15
_REAP_BATCH = 500
# After Redis came back empty, a claim miss is "no answer" (503) this long, while
# every claimant's next heartbeat writes its claims back.
RESTORE_GRACE_SECONDS = 3 * HEARTBEAT_SECONDS
_EPOCH_KEY = KEY_PREFIX + "epoch"
REGISTRATION_PREFIX = KEY_PREFIX + "worker:"
# A refused or reset connection fails at once; these bound a Redis that hangs.
# They are generous because a worker's event loop may lag by seconds under a
# burst, and a late reply is not a lost store. The deadline bounds a whole
# call (waiting for a pooled connection, connecting, the reply); the socket
# timeouts only back it up.
STORE_DEADLINE_SECONDS = 10.0
_CONNECT_TIMEOUT_SECONDS = 2.0
_REPLY_TIMEOUT_SECONDS = STORE_DEADLINE_SECONDS
_POOL_WAIT_SECONDS = STORE_DEADLINE_SECONDS
_ADDRESS_CACHE_SIZE = 4096
_MAX_CONNECTIONS = 64

_T = TypeVar("_T")

# Lua shared by the scripts that answer who holds a claim.
#
# settling(epoch key, grace ms): why no claim lookup can be trusted right now,
# or false. Redis has lost its data (no epoch), or came back empty moments ago
# and the claimants are still writing their claims back.
#
# holder(claim key, owner, registration prefix, orphan ms, epoch key, grace ms):
# {owner, address} if the owner is registered; else, unless Redis is settling
# ({'', reason}: an unregistered owner may only not have renewed yet), {owner}
# after giving the orphaned claim an expiry unless it has one.
_HOLDER_LUA = """
local function settling(epoch_key, grace_ms)
  local epoch = redis.call('GET', epoch_key)
  if not epoch then return 'has lost its data' end
  local since = tonumber(string.match(epoch, '^(%d+):'))
  if since and since > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    if now - since < tonumber(grace_ms) then return 'came back empty moments ago' end
  end
  return false
end

local function holder(key, owner, registration_prefix, orphan_ms, epoch_key, grace_ms)
  local id = string.match(owner, '^([^|]*)')
  local address = redis.call('GET', registration_prefix .. id)
  if address then return {owner, address} end
  local reason = settling(epoch_key, grace_ms)
  if reason then return {'', reason} end
  if redis.call('PTTL', key) == -1 then redis.call('PEXPIRE', key, orphan_ms) end
  return {owner}
end
"""

# Claim unless claimed: false on success, else what `holder` says of the
# claimant ({our id} if it is this worker); {'', 'lost', worker, registration}
# when the claim is gone but another worker's index still lists it. KEYS = [claim key, this worker's
# claim index, the set of workers with an index]; ARGV = [worker id, claim
# name, registration prefix, orphan ms, epoch key, grace ms, restoring]. The
# index (claim names per worker) lets the reaper find the claims of a dead
# worker that nobody asks about. While Redis is settling only a restoring
# claimant may write a claim that is not there.
_CREATE = (
    _HOLDER_LUA
    + """
if ARGV[7] ~= '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  local reason = settling(ARGV[5], ARGV[6])
  if reason then return {'', reason} end
  -- A claim that vanished (evicted, deleted) while its worker still indexes
  -- it: that worker holds the session; never take the id over.
  for _, worker in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    if worker ~= ARGV[8] and redis.call('SISMEMBER', ARGV[9] .. worker, ARGV[2]) == 1 then
      return {'', 'lost', worker, redis.call('GET', ARGV[3] .. worker)}
    end
  end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[8])
  return false
end
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[8])
  return {owner}
end
redis.call('SREM', KEYS[2], ARGV[2])
if ARGV[7] == '1' then return {owner} end
return holder(KEYS[1], owner, ARGV[3], ARGV[4], ARGV[5], ARGV[6])
"""
)
# Who holds KEYS[1]: false (nobody) or what `holder` says. ARGV = [registration
# prefix, orphan ms, epoch key, grace ms]. A miss while Redis is settling is no
# answer either.
_READ = (
    _HOLDER_LUA
    + """
local owner = redis.call('GET', KEYS[1])
if owner then return holder(KEYS[1], owner, ARGV[1], ARGV[2], ARGV[3], ARGV[4]) end
local reason = settling(ARGV[3], ARGV[4])
if reason then return {'', reason} end
return false
"""
)
# The claim scripts below get KEYS = [claim key, this worker's claim index, the
# set of workers with an index] and ARGV = [worker id, claim name, ...].
_REMOVE = """
redis.call('SREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Keep our claim without expiry (ARGV[3] = 0) or with ARGV[3] ms of it; write
# it again if it is gone; 0 if another worker holds it.
_KEEP = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
  redis.call('SREM', KEYS[2], ARGV[2])
  return 0
end
if not owner then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[4])
end
if tonumber(ARGV[3]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
else
  redis.call('PERSIST', KEYS[1])
end
return 1
"""
# KEYS = [a worker's claim index, its registration, the set of indexed
# workers]; ARGV = [its id, orphan ms, claim key prefix, batch]. If the worker
# is unregistered, give up to ARGV[4] of its claims that have no expiry the
# orphan expiry; returns {reaped, left} ({-1, 0} if it is registered).
_REAP = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {-1, 0} end
local reaped = 0
for _, name in ipairs(redis.call('SPOP', KEYS[1], tonumber(ARGV[4]))) do
  local key = ARGV[3] .. name
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, #ARGV[1] + 1) == ARGV[1] .. '|'
     and redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, ARGV[2])
    reaped = reaped + 1
  end
end
local left = redis.call('SCARD', KEYS[1])
if left == 0 then redis.call('SREM', KEYS[3], ARGV[1]) end
return {reaped, left}
"""
# KEYS = [this worker's registration, the epoch key]; ARGV = [address, ttl ms,
# 'start' or 'renew', random]. Returns {whether the registration existed,
# epoch}. The epoch names one lifetime of Redis's data: a worker's start-up
# creates it on an empty Redis ("0:..."); a renewing worker that finds it gone
# (Redis came back empty) creates it stamped with Redis's clock, and claim
# misses answer "no answer" for a grace period while claimants write back.
_REGISTER = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  local since = '0'
  if ARGV[3] == 'renew' then
    local t = redis.call('TIME')
    since = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  end
  epoch = since .. ':' .. ARGV[4]
  redis.call('SET', KEYS[2], epoch)
end
return {existed, epoch}
"""


class EntrySigner:
    """Signs and checks the values workers write to Redis (claims and registrations).

    Args:
        secret: The server secret; a key for this purpose alone is derived from it.
    """

    def __init__(self, secret: str) -> None:
        purpose = b"gym-sessions/redis-entries"
        self._key = hmac.new(secret.encode(), purpose, hashlib.sha256).digest()

    def _mac(self, *parts: str) -> str:
        message = "\0".join(parts).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:32]

    def claim_value(self, name: str, worker_id: str, address: str) -> str:
        """The value of claim ``name`` held by ``worker_id`` listening at ``address``."""
        return f"{worker_id}|{address}|{self._mac('claim', name, worker_id, address)}"

    def read_claim(self, name: str, value: str) -> tuple[str, str]:
        """``(worker id, address)`` of a claim value.

        Raises:
            ClaimsUnavailableError: the value is not signed with this server's secret.
        """
        worker_id, _, rest = value.partition("|")
        address, _, mac = rest.rpartition("|")
        expected = self._mac("claim", name, worker_id, address)
        if not address or not hmac.compare_digest(mac, expected):
            raise _unsigned("a claim")
        return worker_id, address

    def registration_value(self, worker_id: str, address: str) -> str:
        """The value of ``worker_id``'s registration at ``address``."""
        return f"{address}|{self._mac('worker', worker_id, address)}"

    def read_registration(self, worker_id: str, value: str) -> str:
        """The address in a registration value.

        Raises:
            ClaimsUnavailableError: the value is not signed with this server's secret.
        """
        address, _, mac = value.rpartition("|")
        if not address or not hmac.compare_digest(mac, self._mac("worker", worker_id, address)):
            raise _unsigned("a worker registration")
        return address


def _unsigned(what: str) -> ClaimsUnavailableError:
    return ClaimsUnavailableError(
        f"the claim store holds {what} not signed with this server's secret (altered or "
        "forged): treated as missing"
    )


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
        _check_eviction(client, url)
    except (redis.RedisError, OSError, ValueError) as exc:
        raise StartupError(f"cannot reach the claim store at {url}: {exc}") from exc
    finally:
        client.close()


def _check_eviction(client: redis.Redis, url: str) -> None:
    """Refuse a Redis that may evict keys: an evicted claim or registration is a lie.

    Raises:
        StartupError: a memory limit with an evicting policy.
    """
    try:
        config = client.config_get("maxmemory*")
    except redis.ResponseError:  # CONFIG renamed or forbidden (managed Redis)
        logger.warning(
            "cannot read the maxmemory-policy of %s: make sure it is 'noeviction' (an evicted "
            "claim or registration makes live sessions look gone or unknown)",
            url,
        )
        return
    policy = config.get("maxmemory-policy", "noeviction")
    if int(config.get("maxmemory", "0") or 0) > 0 and policy != "noeviction":
        raise StartupError(
            f"the claim store at {url} may evict keys (maxmemory-policy {policy}): an evicted "
            "claim or registration makes live sessions look gone or unknown; set "
            "maxmemory-policy noeviction (or no maxmemory) for its database"
        )


async def _call(operation: Awaitable[_T], deadline: float) -> _T:
    try:
        async with asyncio.timeout(deadline):
            return await operation
    except TimeoutError as exc:
        # Cancelling a command mid-reply is safe: redis-py drops that connection.
        raise ClaimsUnavailableError(
            f"the claim store did not answer within {deadline:g} s"
        ) from exc
    except (redis.RedisError, OSError) as exc:
        raise ClaimsUnavailableError(f"the claim store is unreachable: {exc}") from exc


async def _scan_all(client: Any, pattern: str) -> list[str]:
    return [key async for key in client.scan_iter(match=pattern, count=500)]


class WorkerRegistry:
    """Worker addresses in Redis: this worker's registration and a cache of the others'.

    Args:
        client: The worker's Redis client.
        worker_id: This worker's id.
        clock: Monotonic clock.
        deadline: Seconds one Redis call may take in all before it counts as
            unavailable (503).
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        worker_id: str,
        signer: EntrySigner,
        clock: Callable[[], float] = time.monotonic,
        renewal_client: redis.Redis | None = None,
        deadline: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        self.client = client
        self.deadline = deadline
        self.renewal_client = renewal_client
        self.worker_id = worker_id
        self.signer = signer
        self.key_prefix = REGISTRATION_PREFIX
        self.address: str | None = None
        self.epoch: str | None = None
        self.last_registered = float("-inf")
        self._clock = clock
        self._register = client.register_script(_REGISTER)
        self._restore_due = False
        # Worker id -> (host, port) of registered workers. An id's address never
        # changes; whether the worker lives is asked again whenever a claim is read.
        self._known: dict[str, tuple[str, int]] = {}
        # Worker id -> the address its claims name: where to ask whether an
        # unregistered worker is gone or only slow to renew.
        self._claimed: dict[str, tuple[str, int]] = {}

    def remember(self, worker_id: str, registration: str | None, claimed: str | None) -> None:
        """Record what a claim read said about ``worker_id``.

        Args:
            worker_id: The claimant.
            registration: Its registration's (signed) value; ``None``: not registered.
            claimed: The address its claim names (already verified).

        Raises:
            ClaimsUnavailableError: the registration is not signed with the secret.
        """
        if claimed is not None:
            _bounded_put(self._claimed, worker_id, _split_address(claimed))
        if registration is None:
            self._known.pop(worker_id, None)
            return
        address = self.signer.read_registration(worker_id, registration)
        _bounded_put(self._known, worker_id, _split_address(address))

    async def lookup(self, worker_id: str) -> tuple[str, int] | None:
        """The private address of ``worker_id``, or ``None`` if it is not registered."""
        known = self._known.get(worker_id)
        if known is not None:
            return known
        registration = await _call(self.client.get(self.key_prefix + worker_id), self.deadline)
        self.remember(worker_id, registration, None)
        return self._known.get(worker_id)

    def claimed_address(self, worker_id: str) -> tuple[str, int] | None:
        """The address ``worker_id``'s claims name (whether it is registered or not)."""
        return self._claimed.get(worker_id)

    def registered_within(self, seconds: float) -> bool:
        """Whether this worker's registration was written in the last ``seconds``."""
        return self._clock() - self.last_registered < seconds

    async def worker_ids(self) -> list[str]:
        """Ids of every registered worker, on every host.

        Raises:
            ClaimsUnavailableError: Redis cannot be reached.
        """
        pattern = self.key_prefix + "*"
        keys = await _call(_scan_all(self.client, pattern), self.deadline)
        return [key[len(self.key_prefix) :] for key in keys]

    async def register(self, host: str, port: int) -> None:
        """Register this worker's private address at start-up."""
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._registration = self.signer.registration_value(self.worker_id, self.address)
        await self._write("start")

    async def renew(self) -> bool:
        """Renew the registration; ``False`` if this worker must write its claims back.

        That is when the registration had lapsed (Redis was out of reach past
        its expiry, or lost its data) or Redis's data is of another lifetime.
        """
        epoch = self.epoch
        # Past its lifetime since the last confirmed write, the registration
        # may have lapsed and come back (a renewal whose reply was lost):
        # readers may have given this worker's claims an orphan's expiry.
        may_have_lapsed = not self.registered_within(REGISTRATION_SECONDS)
        existed = await self._write("renew")
        return existed and self.epoch == epoch and not may_have_lapsed

    def _register_args(self, mode: str) -> dict[str, list[Any]]:
        return {
            "keys": [self.key_prefix + self.worker_id, _EPOCH_KEY],
            "args": [
                self._registration,
                int(REGISTRATION_SECONDS * 1000),
                mode,
                secrets.token_hex(8),
            ],
        }

    async def _write(self, mode: str) -> bool:
        assert self.address is not None
        started = self._clock()
        existed, epoch = await _call(self._register(**self._register_args(mode)), self.deadline)
        self.last_registered = started
        self.epoch = epoch
        return bool(existed)

    def renew_blocking(self) -> bool:
        """`renew` from a thread, on the blocking client (the event loop may be busy).

        Raises:
            ClaimsUnavailableError: Redis cannot be reached.
        """
        assert self.renewal_client is not None and self.address is not None
        epoch = self.epoch
        may_have_lapsed = not self.registered_within(REGISTRATION_SECONDS)
        started = self._clock()
        script = self.renewal_client.register_script(_REGISTER)
        try:
            existed, new_epoch = script(**self._register_args("renew"))
        except (redis.RedisError, OSError) as exc:
            raise ClaimsUnavailableError(f"the claim store is unreachable: {exc}") from exc
        self.last_registered = started
        self.epoch = new_epoch
        return bool(existed) and new_epoch == epoch and not may_have_lapsed

    def start_renewal_thread(self) -> threading.Event:
        """Renew the registration from a thread of its own until the returned event is set.

        A long ``env.step`` or any stall of the event loop must not let the
        registration lapse: the worker is busy, not gone. Restores and reaping
        still run on the loop (`run_heartbeat` picks up what the thread found).
        """
        stop = threading.Event()

        def renew_until_stopped() -> None:
            while not stop.wait(HEARTBEAT_SECONDS):
                try:
                    if not self.renew_blocking():
                        self._restore_due = True
                except ClaimsUnavailableError as exc:
                    logger.warning("worker %s: claim store unreachable: %s", self.worker_id, exc)
                except Exception:
                    logger.exception("worker %s: renewing its registration failed", self.worker_id)

        threading.Thread(
            target=renew_until_stopped, name=f"gym-sessions-heartbeat-{self.worker_id}", daemon=True
        ).start()
        return stop

    async def unregister(self) -> None:
        """Remove this worker's registration: its sessions get 410 at once."""
        await _call(self.client.delete(self.key_prefix + self.worker_id), self.deadline)

    async def run_heartbeat(
        self,
        on_lapse: Callable[[], Awaitable[object]],
        reap: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Renew until cancelled.

        When `renew` says so, run ``on_lapse`` (write the claims back), and every
        `REAP_EVERY_BEATS` beats (from a random first beat, so workers take
        turns) run ``reap``. Both run beside the renewals, so a long restore
        never lets the registration lapse.
        """
        beat = secrets.randbelow(REAP_EVERY_BEATS)
        maintenance: asyncio.Task[None] | None = None
        # With a blocking client, a thread renews (a busy loop cannot stall it);
        # this loop only runs the upkeep the renewals ask for.
        stop_thread = self.start_renewal_thread() if self.renewal_client is not None else None
        try:
            while True:
                await asyncio.sleep(HEARTBEAT_SECONDS)
                beat += 1
                if stop_thread is None:
                    try:
                        if not await self.renew():
                            self._restore_due = True
                    except ClaimsUnavailableError as exc:
                        logger.warning(
                            "worker %s: claim store unreachable: %s", self.worker_id, exc
                        )
                        continue
                if maintenance is not None and not maintenance.done():
                    continue
                if self._restore_due:
                    self._restore_due = False
                    maintenance = asyncio.create_task(self._maintain(on_lapse, restore=True))
                elif reap is not None and beat % REAP_EVERY_BEATS == 0:
                    maintenance = asyncio.create_task(self._maintain(reap, restore=False))
        finally:
            if stop_thread is not None:
                stop_thread.set()
            if maintenance is not None:
                maintenance.cancel()

    async def _maintain(self, job: Callable[[], Awaitable[object]], *, restore: bool) -> None:
        try:
            await job()
        except Exception as exc:
            if restore:
                self._restore_due = True  # try again at the next beat
            if isinstance(exc, ClaimsUnavailableError):
                logger.warning("worker %s: claim store unreachable: %s", self.worker_id, exc)
            else:
                logger.exception("worker %s: claim store upkeep failed", self.worker_id)


def _bounded_put(cache: dict[str, tuple[str, int]], key: str, value: tuple[str, int]) -> None:
    if key not in cache and len(cache) >= _ADDRESS_CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class RedisClaimStore:
    """`ClaimStore` on Redis, shared by every worker of every host.

    Args:
        client: The worker's Redis client.
        registry: Worker registrations (filled with what claim reads learn).
        orphan_seconds: How long a dead worker's claim keeps answering 410
            after a reader or the reaper finds it (the window plus a margin).
    """

    expires = True
    claim_prefix = KEY_PREFIX + "claim:"
    index_prefix = KEY_PREFIX + "claims_of:"
    indexed_workers_key = KEY_PREFIX + "indexed_workers"

    def __init__(
        self, client: redis.asyncio.Redis, registry: WorkerRegistry, orphan_seconds: float
    ) -> None:
        self.client = client
        self.registry = registry
        self.worker_id = registry.worker_id
        self.orphan_seconds = orphan_seconds
        self._create = client.register_script(_CREATE)
        self._read = client.register_script(_READ)
        self._remove = client.register_script(_REMOVE)
        self._keep = client.register_script(_KEEP)
        self._reap = client.register_script(_REAP)
        self._orphan_ms = max(1, int(orphan_seconds * 1000))
        self._grace_ms = int(RESTORE_GRACE_SECONDS * 1000)
        self.index_key = self.index_prefix + self.worker_id

    @classmethod
    def key(cls, session_id: str) -> str:
        """The Redis key of a session's claim."""
        return cls.claim_prefix + claim_name(session_id)

    def _run(self, script: Any, session_id: str, *extra: object) -> Awaitable[Any]:
        name = claim_name(session_id)
        mine = self.registry.signer.claim_value(name, self.worker_id, self.registry.address or "")
        return _call(
            script(
                keys=[self.claim_prefix + name, self.index_key, self.indexed_workers_key],
                args=[mine, name, *extra, self.worker_id],
            ),
            self.registry.deadline,
        )

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        """`ClaimStore.create`; ``restoring`` writes a claim back even while Redis settles.

        A claim that vanished from Redis while its worker's index still lists it
        is written back for that worker (if it is registered) rather than taken
        over: one session never gets two envs.
        """
        found = await self._run(
            self._create,
            session_id,
            *self._lookup_args(),
            "1" if restoring else "0",
            self.worker_id,
            self.index_prefix,
        )
        if found and found[0] == "" and found[1] == "lost":
            return await self._give_back(session_id, found[2], found[3] if len(found) > 3 else None)
        return self._holder(session_id, found)

    async def _give_back(self, session_id: str, worker_id: str, registration: str | None) -> str:
        """Write back the vanished claim of ``worker_id``; returns that worker's id.

        Raises:
            ClaimsUnavailableError: that worker is not registered (it may be slow
                or gone: nobody can tell yet), or the claim is held meanwhile.
        """
        if registration is None:
            raise ClaimsUnavailableError(
                f"the claim of this session vanished from the claim store while worker "
                f"{worker_id} indexes it, and that worker is not registered; retry shortly"
            )
        address = self.registry.signer.read_registration(worker_id, registration)
        name = claim_name(session_id)
        value = self.registry.signer.claim_value(name, worker_id, address)
        written = await _call(
            self.client.set(self.claim_prefix + name, value, nx=True), self.registry.deadline
        )
        if not written:
            raise ClaimsUnavailableError("the claim of this session changed meanwhile; retry")
        logger.warning("claim of a session held by worker %s had vanished: written back", worker_id)
        self.registry.remember(worker_id, registration, address)
        return worker_id

    async def read(self, session_id: str) -> str | None:
        found = await _call(
            self._read(keys=[self.key(session_id)], args=self._lookup_args()),
            self.registry.deadline,
        )
        return self._holder(session_id, found)

    def _lookup_args(self) -> list[object]:
        return [self.registry.key_prefix, self._orphan_ms, _EPOCH_KEY, self._grace_ms]

    def _holder(self, session_id: str, found: Any) -> str | None:
        """A claim script's answer: the holder's id (its address remembered), or ``None``.

        Raises:
            ClaimsUnavailableError: Redis is settling, or the claim or the
                holder's registration is not signed with this server's secret.
        """
        if not found:
            return None
        value = found[0]
        if not value:
            raise ClaimsUnavailableError(
                f"the claim store {found[1]}: its claims are being written back; retry shortly"
            )
        owner, address = self.registry.signer.read_claim(claim_name(session_id), value)
        if owner != self.worker_id:
            self.registry.remember(owner, found[1] if len(found) > 1 else None, address)
        return owner

    async def remove(self, session_id: str) -> None:
        await self._run(self._remove, session_id)

    async def hold(self, session_id: str) -> bool:
        return bool(await self._run(self._keep, session_id, 0))

    async def expire(self, session_id: str, seconds: float) -> bool:
        return bool(await self._run(self._keep, session_id, max(1, int(seconds * 1000))))

    async def reap_orphans(self) -> int:
        """Give the claims of unregistered workers an expiry; returns how many.

        A reader already does this for a claim it finds; this finds the ones
        nobody asks about (sessions that were open when their worker died), so
        Redis does not keep them forever. Works in batches, so Redis is never
        held up long by a dead worker with many claims.
        """
        workers = await _call(
            self.client.smembers(self.indexed_workers_key), self.registry.deadline
        )
        reaped = 0
        for worker_id in workers:
            if worker_id == self.worker_id:
                continue
            left = 1
            while left:
                count, left = await _call(
                    self._reap(
                        keys=[
                            self.index_prefix + worker_id,
                            self.registry.key_prefix + worker_id,
                            self.indexed_workers_key,
                        ],
                        args=[worker_id, self._orphan_ms, self.claim_prefix, _REAP_BATCH],
                    ),
                    self.registry.deadline,
                )
                if count < 0:
                    break  # registered: alive
                reaped += count
        return reaped

    async def close(self) -> None:
        """Close the clients' connections."""
        await self.client.aclose()
        if self.registry.renewal_client is not None:
            self.registry.renewal_client.close()
