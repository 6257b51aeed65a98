"""Worker registrations in Redis: this worker's, kept alive by its heartbeat, and the others'.

``gym_sessions:worker:<worker id>`` = ``host:port|<MAC>`` of a worker's
private TCP listener, with a short expiry (`REGISTRATION_SECONDS`) that the
worker's heartbeat renews every `HEARTBEAT_SECONDS`. A claim whose worker has
no registration belongs to a dead (or cut off) worker. Values are signed
(`EntrySigner`): Redis is not trusted for integrity. The heartbeat also runs
the upkeep every worker shares: the reaping of dead workers' claims, the
eviction check (`EvictionWatch`) and the rewrite of claims after Redis came
back empty.
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
from typing import Any, cast

import redis
import redis.asyncio

from gym_sessions.errors import ClaimsUnavailableError
from gym_sessions.routing.keys import (
    EPOCH_KEY,
    REGISTRATION_PREFIX,
)
from gym_sessions.routing.redis_connection import STORE_DEADLINE_SECONDS, call_redis
from gym_sessions.routing.redis_eviction import EvictionWatch
from gym_sessions.routing.redis_scripts import REGISTER_SCRIPT, RegisterArgs

__all__ = [
    "HEARTBEAT_SECONDS",
    "REGISTRATION_SECONDS",
    "EntrySigner",
    "WorkerRegistry",
    "join_address",
    "split_address",
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
_ADDRESS_CACHE_SIZE = 4096


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
        self._register = client.register_script(REGISTER_SCRIPT)
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
            _bounded_put(self._claimed, worker_id, split_address(claimed))
        if registration is None:
            self._known.pop(worker_id, None)
            return
        address = self.signer.read_registration(worker_id, registration)
        _bounded_put(self._known, worker_id, split_address(address))

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

    def _register_args(self, mode: str) -> RegisterArgs:
        return RegisterArgs(
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
        script = self.renewal_client.register_script(REGISTER_SCRIPT)
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


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
