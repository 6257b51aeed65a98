"""Claims and worker addresses in Redis, for workers on several hosts (``claims = "redis://..."``).

Keys, under one prefix per Redis database:

- ``gym_sessions:claim:<sha256 of the session id>`` = ``<worker id>|<its private
  address>|<MAC>``: the holder and where it listens. Created with ``SET NX``
  (two workers never both hold an id); only the
  holder changes or removes it, and every change compares the value first
  (a script), so a late removal can never delete another worker's claim. No
  expiry while the session is open or a request for it is in flight; the
  holder gives it one (its window plus a margin) when it goes idle and not
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
  worker before its holder has written it back.

Redis is not trusted for integrity: claim and registration values carry an
HMAC-SHA256 (key derived from the server secret for this purpose, truncated to
128 bits) over the claim name or worker id and the rest of the value. A value
that does not verify is treated as missing and answered 503 (never forwarded
to), so whoever can write Redis without the secret can deny service but cannot
receive a forwarded request or feed a client.

Reading a claim and its worker's address is one round trip (a script). Each
script's KEYS and ARGV are the fields of one `_ScriptArgs` dataclass, which the
script's Lua binds by name; the claim scripts' replies become one `ClaimReply`
each (`parse_claim_reply`). Redis errors become `ClaimsUnavailableError` (503
``claims_unavailable``); the client retries once at once (a pooled connection
may predate a Redis restart).
A stopped Redis (refused or reset connections) fails at once; one that hangs
fails once a call has taken `STORE_DEADLINE_SECONDS` (10 s) in all, waiting for
a pooled connection included: long enough that a worker's own lag under a
burst is never taken for a lost Redis (the stress run found that), and one
bound, not a pool wait plus a reply timeout one after the other.
The scripts read a key they are not given (the worker registration), which is
fine on one Redis server or a replicated pair, not on Redis Cluster.

A Redis that evicts keys (a ``maxmemory`` with a policy other than
``noeviction``) is refused at start-up and watched for afterwards
(`EvictionWatch`): while it may evict, a missing claim may be an evicted one,
so no absence is believed (503, never "unknown").
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import redis
import redis.asyncio

from gym_sessions.errors import ClaimsUnavailableError, StartupError
from gym_sessions.routing.keys import (
    CLAIM_PREFIX,
    EPOCH_KEY,
    INDEX_PREFIX,
    INDEXED_WORKERS_KEY,
    REGISTRATION_PREFIX,
    claim_name,
    snapshot_key,
)
from gym_sessions.routing.redis_connection import STORE_DEADLINE_SECONDS, call_redis

__all__ = [
    "EntrySigner",
    "EvictionWatch",
    "RedisClaimStore",
    "WorkerRegistry",
    "check_redis",
]

logger = logging.getLogger("gym_sessions.routing")

# A worker's registration lives this long without a heartbeat; heartbeats come
# a few times per period, so one slow Redis reply does not unregister a worker.
REGISTRATION_SECONDS = 10.0
HEARTBEAT_SECONDS = 2.0
# Look for dead workers' forgotten claims about every 30 s (on each worker).
REAP_EVERY_BEATS = 15
# Read Redis's eviction policy again about every 10 s (on each worker), and at
# most once a second besides when a claim is missing (`EvictionWatch`).
EVICTION_CHECK_BEATS = 5
_EVICTION_RECHECK_SECONDS = 1.0
# A worker refusing sessions because Redis evicts says so in its log this often.
_EVICTION_LOG_SECONDS = 10.0
_REAP_BATCH = 500
# After Redis came back empty, a claim miss is "no answer" (503) this long, while
# every holder's next heartbeat writes its claims back.
RESTORE_GRACE_SECONDS = 3 * HEARTBEAT_SECONDS
_ADDRESS_CACHE_SIZE = 4096


@dataclass(frozen=True)
class _ScriptArgs:
    """The KEYS and ARGV of one Lua script, by name.

    A subclass is a dataclass whose fields, in order, are the script's KEYS
    (the first `key_count` fields) and then its ARGV: the layout is written
    once, as those fields. Each script's text starts with `lua_locals`, which
    binds every field's name to its position, so the Lua reads names as well
    and nobody counts positions on either side. ``True``/``False`` go to Redis
    as ``'1'``/``'0'``.
    """

    key_count: ClassVar[int]

    @classmethod
    def lua_locals(cls) -> str:
        """Lua lines binding each field's name to its ``KEYS[i]`` or ``ARGV[i]``."""
        names = [f.name for f in dataclasses.fields(cls)]
        keys, args = names[: cls.key_count], names[cls.key_count :]
        lines = [f"local {name} = KEYS[{i}]" for i, name in enumerate(keys, 1)]
        lines += [f"local {name} = ARGV[{i}]" for i, name in enumerate(args, 1)]
        return "\n".join(lines) + "\n"

    def call(self) -> dict[str, Any]:
        """``keys=`` and ``args=`` of a redis-py script call."""
        values = [
            ("1" if value else "0") if isinstance(value, bool) else value
            for value in (getattr(self, f.name) for f in dataclasses.fields(self))
        ]
        return {"keys": values[: self.key_count], "args": values[self.key_count :]}


# Lua shared by the scripts that answer who holds a claim.
#
# settling(epoch key, grace ms): why no claim lookup can be trusted right now,
# or false. Redis has lost its data (no epoch), or came back empty moments ago
# and the holders are still writing their claims back.
#
# holder(claim key, owner, registration prefix, orphan ms, epoch key, grace ms):
# {owner, registration} if the owner is registered; else, unless Redis is
# settling ({'', reason}: an unregistered owner may only not have renewed yet),
# {owner} after giving the orphaned claim an expiry unless it has one.
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


@dataclass(frozen=True)
class _CreateArgs(_ScriptArgs):
    """`_CREATE`: claim a session for this worker unless another holds it."""

    key_count = 3
    claim_key: str
    #: This worker's claim index (the names of the claims it holds).
    index_key: str
    #: The set of workers with a claim index.
    indexed_workers_key: str
    #: This worker's signed claim value (`EntrySigner.claim_value`).
    claim_value: str
    claim_name: str
    registration_prefix: str
    #: The expiry an unregistered holder's claim gets, in ms.
    orphan_ms: int
    epoch_key: str
    #: How long after Redis came back empty a miss is no answer, in ms.
    grace_ms: int
    #: This worker writes back a claim it holds (allowed while Redis settles).
    restoring: bool
    worker_id: str
    #: Prefix of every worker's claim index.
    index_prefix: str


# Claim unless claimed: nil on success (indexed), else what `holder` says of
# the claimant ({claim_value} if it is this worker's own); {'', 'lost', worker,
# registration} when the claim is gone but another worker's index still lists
# it. The index lets the reaper find the claims of a dead worker that nobody
# asks about. While Redis is settling only a restoring claimant may write a
# claim that is not there.
_CREATE = (
    _CreateArgs.lua_locals()
    + _HOLDER_LUA
    + """
if restoring ~= '1' and redis.call('EXISTS', claim_key) == 0 then
  local reason = settling(epoch_key, grace_ms)
  if reason then return {'', reason} end
  -- A claim that vanished (evicted, deleted) while its worker still indexes
  -- it: that worker holds the session; never take the id over.
  for _, worker in ipairs(redis.call('SMEMBERS', indexed_workers_key)) do
    if worker ~= worker_id and redis.call('SISMEMBER', index_prefix .. worker, claim_name) == 1 then
      return {'', 'lost', worker, redis.call('GET', registration_prefix .. worker)}
    end
  end
end
if redis.call('SET', claim_key, claim_value, 'NX') then
  redis.call('SADD', index_key, claim_name)
  redis.call('SADD', indexed_workers_key, worker_id)
  return false
end
local owner = redis.call('GET', claim_key)
if owner == claim_value then
  redis.call('SADD', index_key, claim_name)
  redis.call('SADD', indexed_workers_key, worker_id)
  return {owner}
end
redis.call('SREM', index_key, claim_name)
if restoring == '1' then return {owner} end
return holder(claim_key, owner, registration_prefix, orphan_ms, epoch_key, grace_ms)
"""
)


@dataclass(frozen=True)
class _ReadArgs(_ScriptArgs):
    """`_READ`: who holds a claim."""

    key_count = 1
    claim_key: str
    registration_prefix: str
    orphan_ms: int
    epoch_key: str
    grace_ms: int


# Nil (nobody) or what `holder` says. A miss while Redis is settling is no answer.
_READ = (
    _ReadArgs.lua_locals()
    + _HOLDER_LUA
    + """
local owner = redis.call('GET', claim_key)
if owner then
  return holder(claim_key, owner, registration_prefix, orphan_ms, epoch_key, grace_ms)
end
local reason = settling(epoch_key, grace_ms)
if reason then return {'', reason} end
return false
"""
)


@dataclass(frozen=True)
class _RemoveArgs(_ScriptArgs):
    """`_REMOVE`: remove this worker's claim (never another worker's)."""

    key_count = 3
    claim_key: str
    index_key: str
    #: The session's snapshot (durable sessions): it ends with the claim.
    snapshot_key: str
    claim_value: str
    claim_name: str


# 1 if the claim was ours and is deleted (with its snapshot), else 0; its name
# leaves our index either way.
_REMOVE = (
    _RemoveArgs.lua_locals()
    + """
redis.call('SREM', index_key, claim_name)
if redis.call('GET', claim_key) == claim_value then
  redis.call('DEL', snapshot_key)
  return redis.call('DEL', claim_key)
end
return 0
"""
)


@dataclass(frozen=True)
class _TakeOverArgs(_ScriptArgs):
    """`_TAKE_OVER`: replace a dead worker's claim by this worker's (durable sessions)."""

    key_count = 5
    claim_key: str
    index_key: str
    indexed_workers_key: str
    #: The dead worker's claim index and registration.
    dead_index_key: str
    dead_registration_key: str
    #: The dead worker's signed claim value, as this worker read it.
    expected_value: str
    #: This worker's signed claim value.
    claim_value: str
    claim_name: str
    worker_id: str
    epoch_key: str
    grace_ms: int


# Compare and set: {1} when the claim still held the dead worker's value and
# that worker is still unregistered (the claim is ours now, without expiry,
# and out of the dead worker's index); {0, value or ''} when it holds something
# else (the winner of a race, or nothing); {-1, reason} while Redis settles or
# if the worker registered again (not dead after all).
_TAKE_OVER = (
    _TakeOverArgs.lua_locals()
    + _HOLDER_LUA
    + """
local reason = settling(epoch_key, grace_ms)
if reason then return {-1, reason} end
local owner = redis.call('GET', claim_key)
if owner ~= expected_value then return {0, owner or ''} end
if redis.call('EXISTS', dead_registration_key) == 1 then return {-1, 'registered again'} end
redis.call('SET', claim_key, claim_value)
redis.call('SREM', dead_index_key, claim_name)
redis.call('SADD', index_key, claim_name)
redis.call('SADD', indexed_workers_key, worker_id)
return {1}
"""
)


@dataclass(frozen=True)
class _KeepArgs(_ScriptArgs):
    """`_KEEP`: keep this worker's claim, with or without expiry."""

    key_count = 3
    claim_key: str
    index_key: str
    indexed_workers_key: str
    claim_value: str
    claim_name: str
    #: The expiry in ms; 0: none.
    expire_ms: int
    worker_id: str
    #: A value found before that is not signed with the secret (forged or
    #: altered): overwritten with ours if it is still there. "": none.
    unsigned_value: str


# Keep our claim without expiry (expire_ms 0) or with one; write it again if it
# is gone (or still holds the unsigned value we were told to overwrite). 1, 2
# if it was gone, or the other value the key holds (the caller checks whether
# it is signed).
_KEEP = (
    _KeepArgs.lua_locals()
    + """
local owner = redis.call('GET', claim_key)
if owner and owner ~= claim_value and owner ~= unsigned_value then
  return owner
end
if owner ~= claim_value then
  redis.call('SET', claim_key, claim_value)
  redis.call('SADD', index_key, claim_name)
  redis.call('SADD', indexed_workers_key, worker_id)
end
if tonumber(expire_ms) > 0 then
  redis.call('PEXPIRE', claim_key, expire_ms)
else
  redis.call('PERSIST', claim_key)
end
if not owner then return 2 end
return 1
"""
)


@dataclass(frozen=True)
class _ReapArgs(_ScriptArgs):
    """`_REAP`: give an unregistered worker's claims the orphan expiry, a batch at a time."""

    key_count = 3
    #: That worker's claim index.
    index_key: str
    #: That worker's registration.
    registration_key: str
    indexed_workers_key: str
    worker_id: str
    orphan_ms: int
    claim_prefix: str
    batch: int


# If the worker is unregistered, give up to a batch of its claims that have no
# expiry the orphan expiry; {reaped, left}, or {-1, 0} if it is registered.
_REAP = (
    _ReapArgs.lua_locals()
    + """
if redis.call('EXISTS', registration_key) == 1 then return {-1, 0} end
local reaped = 0
for _, name in ipairs(redis.call('SPOP', index_key, tonumber(batch))) do
  local key = claim_prefix .. name
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, #worker_id + 1) == worker_id .. '|'
     and redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, orphan_ms)
    reaped = reaped + 1
  end
end
local left = redis.call('SCARD', index_key)
if left == 0 then redis.call('SREM', indexed_workers_key, worker_id) end
return {reaped, left}
"""
)


@dataclass(frozen=True)
class _RegisterArgs(_ScriptArgs):
    """`_REGISTER`: write this worker's registration (and the epoch if it is missing)."""

    key_count = 2
    registration_key: str
    epoch_key: str
    #: The signed registration value (`EntrySigner.registration_value`).
    registration: str
    ttl_ms: int
    #: 'start' (a worker's start-up) or 'renew'.
    mode: str
    #: Random hex, so each lifetime's epoch differs.
    nonce: str


# {whether the registration existed, epoch}. The epoch names one lifetime of
# Redis's data: a worker's start-up creates it on an empty Redis ("0:..."); a
# renewing worker that finds it gone (Redis came back empty) creates it stamped
# with Redis's clock, and claim misses answer "no answer" for a grace period
# while claimants write back.
_REGISTER = (
    _RegisterArgs.lua_locals()
    + """
local existed = redis.call('EXISTS', registration_key)
redis.call('SET', registration_key, registration, 'PX', ttl_ms)
local epoch = redis.call('GET', epoch_key)
if not epoch then
  local since = '0'
  if mode == 'renew' then
    local t = redis.call('TIME')
    since = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  end
  epoch = since .. ':' .. nonce
  redis.call('SET', epoch_key, epoch)
end
return {existed, epoch}
"""
)

#: Each script and the arguments it takes (what the tests check the text against).
_SCRIPTS: dict[str, tuple[type[_ScriptArgs], str]] = {
    "create": (_CreateArgs, _CREATE),
    "read": (_ReadArgs, _READ),
    "remove": (_RemoveArgs, _REMOVE),
    "take_over": (_TakeOverArgs, _TAKE_OVER),
    "keep": (_KeepArgs, _KEEP),
    "reap": (_ReapArgs, _REAP),
    "register": (_RegisterArgs, _REGISTER),
}


@dataclass(frozen=True)
class ClaimFree:
    """Nobody holds the claim (`_CREATE`: this worker has just taken it)."""


@dataclass(frozen=True)
class ClaimHeld:
    """A worker holds the claim.

    Attributes:
        value: The claim's signed value (not verified yet).
        registration: The holder's signed registration, or ``None``: the holder
            is not registered (its claim got an orphan's expiry), or it is this
            worker, or a restore found it (nobody asked).
    """

    value: str
    registration: str | None


@dataclass(frozen=True)
class ClaimSettling:
    """No answer yet: Redis lost its data, or came back empty moments ago.

    Attributes:
        reason: What happened to Redis, as a phrase ("has lost its data").
    """

    reason: str


@dataclass(frozen=True)
class ClaimLost:
    """The claim's key is gone, but ``worker_id``'s index still lists it (`_CREATE` only).

    Attributes:
        worker_id: The worker that holds the session.
        registration: Its signed registration, or ``None`` if it is not registered.
    """

    worker_id: str
    registration: str | None


ClaimReply = ClaimFree | ClaimHeld | ClaimSettling | ClaimLost


def parse_claim_reply(found: Any) -> ClaimReply:
    """What a `_CREATE` or `_READ` reply says.

    The replies: nil → `ClaimFree`; ``{value}`` or ``{value, registration}`` →
    `ClaimHeld`; ``{'', reason}`` → `ClaimSettling`; ``{'', 'lost', worker,
    registration or nil}`` → `ClaimLost`.
    """
    if not found:
        return ClaimFree()
    if found[0]:
        return ClaimHeld(found[0], found[1] if len(found) > 1 else None)
    if len(found) > 2 and found[1] == "lost":
        return ClaimLost(found[2], found[3] if len(found) > 3 else None)
    return ClaimSettling(found[1])


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
    policy = _evicting_policy(config)
    if policy is not None:
        raise StartupError(
            f"the claim store at {url} may evict keys (maxmemory-policy {policy}): an evicted "
            "claim or registration makes live sessions look gone or unknown; set "
            "maxmemory-policy noeviction (or no maxmemory) for its database"
        )


def _evicting_policy(config: Mapping[Any, Any]) -> str | None:
    """The ``maxmemory-policy`` of ``CONFIG GET maxmemory*`` if it may evict keys, else ``None``."""
    policy = str(config.get("maxmemory-policy") or "noeviction")
    if int(config.get("maxmemory") or 0) > 0 and policy != "noeviction":
        return policy
    return None


class EvictionWatch:
    """Whether Redis may evict keys now, rechecked while the server runs (docs/design.md §3.9.7).

    The start-up check refuses an evicting Redis, but its configuration can
    change later (``CONFIG SET maxmemory-policy allkeys-lru``). An evicted claim
    would make a live session look unknown (404) on every worker but its
    holder, and let a start create a second env for it. So while Redis may
    evict, `RedisClaimStore` believes no absence: a read that finds no claim,
    and every new claim, get 503 ``claims_unavailable`` naming the cause, while
    holders serve their sessions from memory. Once Redis does not evict (any
    more) and has evicted keys since the last check (its ``evicted_keys``
    count grew) or stopped evicting, ``on_stop`` runs: the registry then
    writes every claim of this worker back. The count catches an eviction
    that came and went between two checks of this worker.

    Checked every `EVICTION_CHECK_BEATS` heartbeats (`WorkerRegistry.run_heartbeat`)
    and, at most once a second, whenever a claim is missing (`recheck`).

    Args:
        client: The worker's Redis client.
        deadline: Seconds one check may take.
        on_stop: Called when this worker's claims may have been evicted and
            Redis does not evict now.
        clock: Monotonic clock.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        deadline: float,
        on_stop: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.deadline = deadline
        self.on_stop = on_stop
        #: The evicting policy last seen; ``None``: Redis did not evict then.
        self.policy: str | None = None
        self._clock = clock
        self._checked_at = float("-inf")
        self._pending: asyncio.Future[str | None] | None = None
        self._forbidden: set[str] = set()
        self._evicted: int | None = None
        self._write_back_due = False
        self._refusals = 0
        self._logged_at = float("-inf")

    async def _read(self, command: str, call: Awaitable[Any]) -> Mapping[Any, Any]:
        try:
            async with asyncio.timeout(self.deadline):
                return cast("Mapping[Any, Any]", await call)
        except redis.ResponseError:  # renamed or forbidden (managed Redis)
            if command not in self._forbidden:
                self._forbidden.add(command)
                logger.warning("cannot run %s on the claim store: eviction not watched", command)
            return {}

    async def check(self) -> str | None:
        """Read the policy now; log when Redis starts or stops evicting. Returns `policy`."""
        try:
            config = await self._read("CONFIG GET", self.client.config_get("maxmemory*"))
            stats = await self._read("INFO", self.client.info("stats"))
        except (redis.RedisError, OSError, TimeoutError):
            return self.policy  # unreachable: the requests that need Redis say so
        policy = _evicting_policy(config)
        evicted = stats.get("evicted_keys")
        if isinstance(evicted, int):
            if self._evicted is not None and evicted > self._evicted:
                logger.warning(
                    "the claim store evicted %d key(s) since this worker last looked",
                    evicted - self._evicted,
                )
                self._write_back_due = True
            self._evicted = evicted
        if policy is not None and self.policy is None:
            logger.error(
                "the claim store now evicts keys (maxmemory-policy %s, maxmemory %s): a missing "
                "claim may be an evicted one, so sessions whose claim is missing get 503 "
                "claims_unavailable and no session starts until maxmemory-policy is noeviction",
                policy,
                config.get("maxmemory"),
            )
            self._logged_at = self._clock()
        elif policy is None and self.policy is not None:
            logger.warning("the claim store no longer evicts keys")
            self._write_back_due = True
        self.policy = policy
        if policy is None and self._write_back_due:
            self._write_back_due = False
            logger.warning("claims may have been evicted: this worker writes its claims back")
            self.on_stop()
        return policy

    async def recheck(self) -> str | None:
        """`policy`, read again unless a recheck did within the last second (callers share one).

        The periodic checks do not count: a miss right after one still asks.
        """
        if self._pending is None or self._pending.done():
            if self._clock() - self._checked_at < _EVICTION_RECHECK_SECONDS:
                return self.policy
            self._checked_at = self._clock()
            self._pending = asyncio.ensure_future(self.check())
        return await asyncio.shield(self._pending)

    async def refuse_if_evicting(self) -> None:
        """Raise if Redis may evict keys (`recheck`): a key's absence says nothing then.

        Raises:
            ClaimsUnavailableError: it may.
        """
        policy = await self.recheck()
        if policy is not None:
            raise self.refusal(policy)

    def refusal(self, policy: str) -> ClaimsUnavailableError:
        """The 503 for a request that needs a claim's absence while Redis evicts (logged)."""
        self._refusals += 1
        if self._clock() - self._logged_at >= _EVICTION_LOG_SECONDS:
            self._logged_at = self._clock()
            logger.warning(
                "%d request(s) refused with 503: the claim store evicts keys "
                "(maxmemory-policy %s), so a missing claim cannot be told from an evicted one",
                self._refusals,
                policy,
            )
            self._refusals = 0
        return ClaimsUnavailableError(
            f"the claim store evicts keys (maxmemory-policy {policy}): whether this session "
            "exists cannot be told; retry once Redis no longer evicts"
        )


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
        self.eviction = EvictionWatch(client, deadline, self._write_claims_back, clock)
        # Worker id -> (host, port) of registered workers. An id's address never
        # changes; whether the worker lives is asked again whenever a claim is read.
        self._known: dict[str, tuple[str, int]] = {}
        # Worker id -> the address its claims name: where to ask whether an
        # unregistered worker is gone or only slow to renew.
        self._claimed: dict[str, tuple[str, int]] = {}

    def _write_claims_back(self) -> None:
        self._restore_due = True  # the next beat writes every claim back

    def remember(self, worker_id: str, registration: str | None, claimed: str | None) -> None:
        """Record what a claim read said about ``worker_id``.

        Args:
            worker_id: The holder.
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
        registration = await call_redis(self.client.get(self.key_prefix + worker_id), self.deadline)
        self.remember(worker_id, cast("str | None", registration), None)  # decoded replies
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
        keys = await call_redis(_scan_all(self.client, pattern), self.deadline)
        return [key[len(self.key_prefix) :] for key in keys]

    async def register(self, host: str, port: int) -> None:
        """Register this worker's private address at start-up."""
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._registration = self.signer.registration_value(self.worker_id, self.address)
        await self._write("start")
        await self.eviction.check()  # what Redis has evicted so far: the baseline

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

    def _register_args(self, mode: str) -> _RegisterArgs:
        return _RegisterArgs(
            registration_key=self.key_prefix + self.worker_id,
            epoch_key=EPOCH_KEY,
            registration=self._registration,
            ttl_ms=int(REGISTRATION_SECONDS * 1000),
            mode=mode,
            nonce=secrets.token_hex(8),
        )

    async def _write(self, mode: str) -> bool:
        assert self.address is not None
        started = self._clock()
        existed, epoch = await call_redis(
            self._register(**self._register_args(mode).call()), self.deadline
        )
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
            existed, new_epoch = script(**self._register_args("renew").call())
        except (redis.RedisError, OSError) as exc:
            raise ClaimsUnavailableError(
                f"the claim store is unreachable ({type(exc).__name__})"
            ) from exc
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
        await call_redis(self.client.delete(self.key_prefix + self.worker_id), self.deadline)

    async def run_heartbeat(
        self,
        on_lapse: Callable[[], Awaitable[object]],
        reap: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Renew until cancelled.

        When `renew` says so (or Redis stopped evicting keys), run ``on_lapse``
        (write the claims back), and every `REAP_EVERY_BEATS` beats (from a
        random first beat, so workers take turns) run ``reap``. Both run beside
        the renewals, so a long restore never lets the registration lapse.
        Every `EVICTION_CHECK_BEATS` beats, read Redis's eviction policy again
        (`EvictionWatch`).
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
                if beat % EVICTION_CHECK_BEATS == 0:
                    await self.eviction.check()
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


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# A takeover needs the dead worker's registration gone; a SIGKILLed worker's
# lasts up to REGISTRATION_SECONDS after its last beat. Wait that long (polling)
# rather than answer 410 the client would see.
_LAPSE_POLL_SECONDS = 0.25
_REFUSAL_PROBE_SECONDS = 2.0


async def _refuses(address: tuple[str, int]) -> bool:
    """Whether ``address`` actively refuses TCP connections (nothing listens there).

    Silence is not refusal: a host cut off by a partition may still serve its
    sessions from memory, so only a refusal lets them be taken over.
    """
    try:
        async with asyncio.timeout(_REFUSAL_PROBE_SECONDS):
            _, writer = await asyncio.open_connection(*address)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


class RedisClaimStore:
    """`ClaimStore` on Redis, shared by every worker of every host.

    Args:
        client: The worker's Redis client.
        registry: Worker registrations (filled with what claim reads learn).
        orphan_seconds: How long a dead worker's claim keeps answering 410
            after a reader or the reaper finds it (the window plus a margin).
        keep_orphans_seconds: With durable sessions, how long a dead worker's
            claim stays instead, when longer: as long as its snapshot may still
            be restored. A takeover needs the claim to name the dead holder, so
            a claim gone sooner would turn a client that comes back later into
            a "no open episode" on a fresh worker while the snapshot still exists.
    """

    expires = True
    claim_prefix = CLAIM_PREFIX
    index_prefix = INDEX_PREFIX
    indexed_workers_key = INDEXED_WORKERS_KEY

    def __init__(
        self,
        client: redis.asyncio.Redis,
        registry: WorkerRegistry,
        orphan_seconds: float,
        keep_orphans_seconds: float = 0.0,
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
        self._take_over = client.register_script(_TAKE_OVER)
        # `trusted_for` counts with the shorter `orphan_seconds`: the safe side.
        self._orphan_ms = max(1, int(max(orphan_seconds, keep_orphans_seconds) * 1000))
        self._grace_ms = int(RESTORE_GRACE_SECONDS * 1000)
        self.index_key = self.index_prefix + self.worker_id

    def trusted_for(self) -> float:
        """Seconds after its last registration write this worker may serve its claims from memory.

        Another worker can take one of this worker's claims over only after all of:

        - its registration expired: `REGISTRATION_SECONDS` after the last write
          that succeeded (counted from when that write began, so never late);
        - then a reader or the reaper found the claim unregistered and gave it
          the orphan expiry (``orphan_seconds``: the window plus
          `EXPIRY_MARGIN_SECONDS` as the app sets it), which ran out.

        Less one `HEARTBEAT_SECONDS`, kept as a margin: a request admitted just
        before the bound still ends well before a takeover can happen. Past it,
        `standing` is false and every request under a claim gets 503.
        """
        return REGISTRATION_SECONDS + self.orphan_seconds - HEARTBEAT_SECONDS

    def standing(self) -> bool:
        """Whether nobody can have taken this worker's claims over yet (`OwnedClaims` standing)."""
        return self.registry.registered_within(self.trusted_for())

    @classmethod
    def key(cls, session_id: str) -> str:
        """The Redis key of a session's claim."""
        return cls.claim_prefix + claim_name(session_id)

    def _run(self, script: Any, args: _ScriptArgs) -> Awaitable[Any]:
        return call_redis(script(**args.call()), self.registry.deadline)

    def _mine(self, session_id: str) -> tuple[str, str]:
        """The claim name of ``session_id`` and this worker's signed value for it."""
        name = claim_name(session_id)
        value = self.registry.signer.claim_value(name, self.worker_id, self.registry.address or "")
        return name, value

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        """`ClaimStore.create`; ``restoring`` writes a claim back even while Redis settles.

        A claim that vanished from Redis while its worker's index still lists it
        is written back for that worker (if it is registered) rather than taken
        over: one session never gets two envs.
        """
        if not restoring:
            await self._refuse_if_evicting()
        name, value = self._mine(session_id)
        args = _CreateArgs(
            claim_key=self.claim_prefix + name,
            index_key=self.index_key,
            indexed_workers_key=self.indexed_workers_key,
            claim_value=value,
            claim_name=name,
            registration_prefix=self.registry.key_prefix,
            orphan_ms=self._orphan_ms,
            epoch_key=EPOCH_KEY,
            grace_ms=self._grace_ms,
            restoring=restoring,
            worker_id=self.worker_id,
            index_prefix=self.index_prefix,
        )
        return await self._holder(
            session_id, parse_claim_reply(await self._run(self._create, args))
        )

    async def _give_back(self, session_id: str, lost: ClaimLost) -> str:
        """Write back the vanished claim of ``lost.worker_id``; returns that worker's id.

        Raises:
            ClaimsUnavailableError: that worker is not registered (it may be slow
                or gone: nobody can tell yet), or the claim is held meanwhile.
        """
        await self._refuse_if_evicting()
        worker_id, registration = lost.worker_id, lost.registration
        if registration is None:
            raise ClaimsUnavailableError(
                f"the claim of this session vanished from the claim store while worker "
                f"{worker_id} indexes it, and that worker is not registered; retry shortly"
            )
        address = self.registry.signer.read_registration(worker_id, registration)
        name = claim_name(session_id)
        value = self.registry.signer.claim_value(name, worker_id, address)
        written = await call_redis(
            self.client.set(self.claim_prefix + name, value, nx=True), self.registry.deadline
        )
        if not written:
            raise ClaimsUnavailableError("the claim of this session changed meanwhile; retry")
        logger.warning("claim of a session held by worker %s had vanished: written back", worker_id)
        self.registry.remember(worker_id, registration, address)
        return worker_id

    async def read(self, session_id: str) -> str | None:
        args = _ReadArgs(
            claim_key=self.key(session_id),
            registration_prefix=self.registry.key_prefix,
            orphan_ms=self._orphan_ms,
            epoch_key=EPOCH_KEY,
            grace_ms=self._grace_ms,
        )
        return await self._holder(session_id, parse_claim_reply(await self._run(self._read, args)))

    async def _holder(self, session_id: str, reply: ClaimReply) -> str | None:
        """The holder's id a claim script's reply names (its address remembered), or ``None``.

        Raises:
            ClaimsUnavailableError: Redis is settling, the claim or the holder's
                registration is not signed with this server's secret, or a
                vanished claim could not be written back for its holder.
        """
        match reply:
            case ClaimFree():
                await self._refuse_if_evicting()  # it may have been evicted
                return None
            case ClaimSettling(reason):
                await self._refuse_if_evicting()  # the epoch may be what was evicted
                raise ClaimsUnavailableError(
                    f"the claim store {reason}: its claims are being written back; retry shortly"
                )
            case ClaimLost():
                return await self._give_back(session_id, reply)
            case ClaimHeld(value, registration):
                holder, address = self.registry.signer.read_claim(claim_name(session_id), value)
                if holder != self.worker_id:
                    self.registry.remember(holder, registration, address)
                return holder

    async def _refuse_if_evicting(self) -> None:
        """Raise if Redis may evict keys (read again at most once a second): no absence is sure.

        Raises:
            ClaimsUnavailableError: it may (`EvictionWatch`).
        """
        await self.registry.eviction.refuse_if_evicting()

    async def holder_exited(self, worker_id: str) -> bool:
        """Gone for a takeover: its registration lapsed and its claimed address refuses.

        A worker whose heartbeat is late but that still listens is slow, not
        gone; one that is silent may be cut off by a partition and still
        serving. Waits up to `REGISTRATION_SECONDS` for the registration of a
        worker that refuses to lapse.
        """
        claimed = self.registry.claimed_address(worker_id)
        if worker_id == self.worker_id or claimed is None:
            return False
        key = self.registry.key_prefix + worker_id
        deadline = time.monotonic() + REGISTRATION_SECONDS + HEARTBEAT_SECONDS
        while await call_redis(self.client.exists(key), self.registry.deadline):
            if time.monotonic() > deadline or not await _refuses(claimed):
                return False
            await asyncio.sleep(_LAPSE_POLL_SECONDS)
        self.registry.remember(worker_id, None, None)  # unregistered: forget its address
        return await _refuses(claimed)

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        """`ClaimStore.take_over`: one Lua compare-and-set on the claim's whole signed value.

        Raises:
            ClaimsUnavailableError: Redis is settling, unreachable, the dead
                worker registered again, or the claim holds an unsigned value.
        """
        claimed = self.registry.claimed_address(dead_holder)
        if claimed is None:
            return dead_holder  # never read its claim: nothing to compare with
        name, value = self._mine(session_id)
        args = _TakeOverArgs(
            claim_key=self.claim_prefix + name,
            index_key=self.index_key,
            indexed_workers_key=self.indexed_workers_key,
            dead_index_key=self.index_prefix + dead_holder,
            dead_registration_key=self.registry.key_prefix + dead_holder,
            expected_value=self.registry.signer.claim_value(
                name, dead_holder, _join_address(*claimed)
            ),
            claim_value=value,
            claim_name=name,
            worker_id=self.worker_id,
            epoch_key=EPOCH_KEY,
            grace_ms=self._grace_ms,
        )
        found = await self._run(self._take_over, args)
        if found[0] == 1:
            return None
        if found[0] == -1:
            raise ClaimsUnavailableError(f"the claim store {found[1]}: retry shortly")
        if not found[1]:
            return dead_holder  # the claim is gone (expired): nothing to restore
        holder, address = self.registry.signer.read_claim(name, found[1])
        self.registry.remember(holder, None, address)
        return holder

    async def remove(self, session_id: str) -> None:
        name, value = self._mine(session_id)
        args = _RemoveArgs(
            claim_key=self.claim_prefix + name,
            index_key=self.index_key,
            snapshot_key=snapshot_key(session_id),
            claim_value=value,
            claim_name=name,
        )
        await self._run(self._remove, args)

    async def hold(self, session_id: str) -> bool:
        return await self._keep_claim(session_id, 0)

    async def expire(self, session_id: str, seconds: float) -> bool:
        return await self._keep_claim(session_id, max(1, int(seconds * 1000)))

    async def _keep_claim(self, session_id: str, expire_ms: int) -> bool:
        name, value = self._mine(session_id)
        args = _KeepArgs(
            claim_key=self.claim_prefix + name,
            index_key=self.index_key,
            indexed_workers_key=self.indexed_workers_key,
            claim_value=value,
            claim_name=name,
            expire_ms=expire_ms,
            worker_id=self.worker_id,
            unsigned_value="",
        )
        found = await self._run(self._keep, args)
        if found == 2:
            # Our claim was gone (it had no expiry, or its expiry had not run
            # out): written back. Evicted, maybe: is Redis evicting now?
            logger.warning("the claim of a session of this worker had vanished: written back")
            await self.registry.eviction.recheck()
        if found in (1, 2):
            return True
        try:
            holder: str | None = self.registry.signer.read_claim(name, found)[0]
        except ClaimsUnavailableError:
            holder = None  # not signed with the secret: nobody's claim, never a takeover
            logger.warning(
                "the claim of a session of this worker was altered in the claim store "
                "(not signed with the secret): written back"
            )
        if holder is not None and holder != self.worker_id:
            # Another worker's genuine claim: it took the id over after ours expired.
            await call_redis(self.client.srem(self.index_key, name), self.registry.deadline)
            return False
        # Still ours: write our value back over the one found, if nothing changed since.
        found = await self._run(self._keep, dataclasses.replace(args, unsigned_value=found))
        if found in (1, 2):
            return True
        raise ClaimsUnavailableError("the claim of this session keeps changing in the claim store")

    async def reap_orphans(self) -> int:
        """Give the claims of unregistered workers an expiry; returns how many.

        A reader already does this for a claim it finds; this finds the ones
        nobody asks about (sessions that were open when their worker died), so
        Redis does not keep them forever. Works in batches, so Redis is never
        held up long by a dead worker with many claims.
        """
        # The clients decode replies (decode_responses=True): members are str.
        workers = cast(
            "set[str]",
            await call_redis(
                self.client.smembers(self.indexed_workers_key), self.registry.deadline
            ),
        )
        reaped = 0
        for worker_id in workers:
            if worker_id == self.worker_id:
                continue
            left = 1
            while left:
                args = _ReapArgs(
                    index_key=self.index_prefix + worker_id,
                    registration_key=self.registry.key_prefix + worker_id,
                    indexed_workers_key=self.indexed_workers_key,
                    worker_id=worker_id,
                    orphan_ms=self._orphan_ms,
                    claim_prefix=self.claim_prefix,
                    batch=_REAP_BATCH,
                )
                count, left = await self._run(self._reap, args)
                if count < 0:
                    break  # registered: alive
                reaped += count
        return reaped

    async def close(self) -> None:
        """Close the clients' connections."""
        await self.client.aclose()
        if self.registry.renewal_client is not None:
            self.registry.renewal_client.close()
