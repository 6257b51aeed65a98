"""A Redis that may evict keys: refused at start-up, watched for afterwards.

A ``maxmemory`` with a policy other than ``noeviction`` lets Redis drop a
claim; while it may, a missing claim may be an evicted one, so no absence is
believed (503 ``claims_unavailable``, never "unknown"): `check_redis` at
start-up, `EvictionWatch` while serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import redis
import redis.asyncio

from gym_sessions.errors import ClaimsUnavailableError, StartupError

__all__ = [
    "EvictionWatch",
    "check_redis",
]

logger = logging.getLogger("gym_sessions.routing")

# At most once a second besides the heartbeat's checks, when a claim is missing.
_EVICTION_RECHECK_SECONDS = 1.0
# A worker refusing sessions because Redis evicts says so in its log this often.
_EVICTION_LOG_SECONDS = 10.0


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
