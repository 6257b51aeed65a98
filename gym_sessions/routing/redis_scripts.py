"""The Lua scripts of Redis claims and registrations, and what the claim scripts answer.

Each script's KEYS and ARGV are the fields of one `ScriptArgs` dataclass,
which the script's Lua binds by name (`ScriptArgs.lua_locals`), so neither
side counts positions; `SCRIPTS` lists every script with its arguments (the
tests check each text against them). The claim scripts' replies become one
`ClaimReply` each (`parse_claim_reply`). What the keys hold:
`gym_sessions.routing.redis_claims`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "CREATE_SCRIPT",
    "KEEP_SCRIPT",
    "READ_SCRIPT",
    "REAP_SCRIPT",
    "REGISTER_SCRIPT",
    "REMOVE_SCRIPT",
    "SCRIPTS",
    "TAKE_OVER_SCRIPT",
    "ClaimFree",
    "ClaimHeld",
    "ClaimLost",
    "ClaimReply",
    "ClaimSettling",
    "CreateArgs",
    "KeepArgs",
    "ReadArgs",
    "ReapArgs",
    "RegisterArgs",
    "RemoveArgs",
    "ScriptArgs",
    "TakeOverArgs",
    "parse_claim_reply",
]

logger = logging.getLogger("gym_sessions.routing")


@dataclass(frozen=True)
class ScriptArgs:
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
class CreateArgs(ScriptArgs):
    """`CREATE_SCRIPT`: claim a session for this worker unless another holds it."""

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
CREATE_SCRIPT = (
    CreateArgs.lua_locals()
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
class ReadArgs(ScriptArgs):
    """`READ_SCRIPT`: who holds a claim."""

    key_count = 1
    claim_key: str
    registration_prefix: str
    orphan_ms: int
    epoch_key: str
    grace_ms: int


# Nil (nobody) or what `holder` says. A miss while Redis is settling is no answer.
READ_SCRIPT = (
    ReadArgs.lua_locals()
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
class RemoveArgs(ScriptArgs):
    """`REMOVE_SCRIPT`: remove this worker's claim (never another worker's)."""

    key_count = 3
    claim_key: str
    index_key: str
    #: The session's snapshot (durable sessions): it ends with the claim.
    snapshot_key: str
    claim_value: str
    claim_name: str


# 1 if the claim was ours and is deleted (with its snapshot), else 0; its name
# leaves our index either way.
REMOVE_SCRIPT = (
    RemoveArgs.lua_locals()
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
class TakeOverArgs(ScriptArgs):
    """`TAKE_OVER_SCRIPT`: replace a dead worker's claim by this worker's (durable sessions)."""

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
TAKE_OVER_SCRIPT = (
    TakeOverArgs.lua_locals()
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
class KeepArgs(ScriptArgs):
    """`KEEP_SCRIPT`: keep this worker's claim, with or without expiry."""

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
KEEP_SCRIPT = (
    KeepArgs.lua_locals()
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
class ReapArgs(ScriptArgs):
    """`REAP_SCRIPT`: give an unregistered worker's claims the orphan expiry, a batch at a time."""

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
REAP_SCRIPT = (
    ReapArgs.lua_locals()
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
class RegisterArgs(ScriptArgs):
    """`REGISTER_SCRIPT`: write this worker's registration (and the epoch if it is missing)."""

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
REGISTER_SCRIPT = (
    RegisterArgs.lua_locals()
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
SCRIPTS: dict[str, tuple[type[ScriptArgs], str]] = {
    "create": (CreateArgs, CREATE_SCRIPT),
    "read": (ReadArgs, READ_SCRIPT),
    "remove": (RemoveArgs, REMOVE_SCRIPT),
    "take_over": (TakeOverArgs, TAKE_OVER_SCRIPT),
    "keep": (KeepArgs, KEEP_SCRIPT),
    "reap": (ReapArgs, REAP_SCRIPT),
    "register": (RegisterArgs, REGISTER_SCRIPT),
}


@dataclass(frozen=True)
class ClaimFree:
    """Nobody holds the claim (`CREATE_SCRIPT`: this worker has just taken it)."""


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
    """The claim's key is gone, but ``worker_id``'s index still lists it (`CREATE_SCRIPT` only).

    Attributes:
        worker_id: The worker that holds the session.
        registration: Its signed registration, or ``None`` if it is not registered.
    """

    worker_id: str
    registration: str | None


ClaimReply = ClaimFree | ClaimHeld | ClaimSettling | ClaimLost


def parse_claim_reply(found: Any) -> ClaimReply:
    """What a `CREATE_SCRIPT` or `READ_SCRIPT` reply says.

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
