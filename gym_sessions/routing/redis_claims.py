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
script's KEYS and ARGV are the fields of one `ScriptArgs` dataclass, which the
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
(`gym_sessions.routing.redis_eviction`): while it may evict, a missing
claim may be an evicted one, so no absence is believed (503, never
"unknown"). Registrations and the heartbeat:
`gym_sessions.routing.redis_registry`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import Any, cast

import redis
import redis.asyncio

from gym_sessions.errors import ClaimsUnavailableError
from gym_sessions.routing.keys import (
    CLAIM_PREFIX,
    EPOCH_KEY,
    INDEX_PREFIX,
    INDEXED_WORKERS_KEY,
    claim_name,
    snapshot_key,
)
from gym_sessions.routing.redis_connection import call_redis
from gym_sessions.routing.redis_registry import (
    HEARTBEAT_SECONDS,
    REGISTRATION_SECONDS,
    WorkerRegistry,
    join_address,
)
from gym_sessions.routing.redis_scripts import (
    CREATE_SCRIPT,
    KEEP_SCRIPT,
    READ_SCRIPT,
    REAP_SCRIPT,
    REMOVE_SCRIPT,
    TAKE_OVER_SCRIPT,
    ClaimFree,
    ClaimHeld,
    ClaimLost,
    ClaimReply,
    ClaimSettling,
    CreateArgs,
    KeepArgs,
    ReadArgs,
    ReapArgs,
    RemoveArgs,
    ScriptArgs,
    TakeOverArgs,
    parse_claim_reply,
)

__all__ = [
    "RESTORE_GRACE_SECONDS",
    "RedisClaimStore",
]

logger = logging.getLogger("gym_sessions.routing")

_REAP_BATCH = 500
# After Redis came back empty, a claim miss is "no answer" (503) this long, while
# every holder's next heartbeat writes its claims back.
RESTORE_GRACE_SECONDS = 3 * HEARTBEAT_SECONDS


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
        self._create = client.register_script(CREATE_SCRIPT)
        self._read = client.register_script(READ_SCRIPT)
        self._remove = client.register_script(REMOVE_SCRIPT)
        self._keep = client.register_script(KEEP_SCRIPT)
        self._reap = client.register_script(REAP_SCRIPT)
        self._take_over = client.register_script(TAKE_OVER_SCRIPT)
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

    def _run(self, script: Any, args: ScriptArgs) -> Awaitable[Any]:
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
        args = CreateArgs(
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
        args = ReadArgs(
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
        args = TakeOverArgs(
            claim_key=self.claim_prefix + name,
            index_key=self.index_key,
            indexed_workers_key=self.indexed_workers_key,
            dead_index_key=self.index_prefix + dead_holder,
            dead_registration_key=self.registry.key_prefix + dead_holder,
            expected_value=self.registry.signer.claim_value(
                name, dead_holder, join_address(*claimed)
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
        args = RemoveArgs(
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
        args = KeepArgs(
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
                args = ReapArgs(
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
