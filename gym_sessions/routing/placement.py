"""Where a new session starts: on the worker with the fewest open sessions (``--placement``).

uvicorn's workers share one listening socket and the kernel hands most
connections of a burst to whichever worker is awake, so sessions pile up where
they were accepted (400 starts at 4 workers measured [2, 53, 151, 194]). With
``balanced`` placement the accepting worker delivers a new session's start (a
start whose id is minted or unclaimed) to the worker with the fewest sessions,
over the router's hop; ``local`` starts it where it arrived, as before.

Every worker publishes its *load* (`OwnedClaims.load`: live sessions plus
starts under way, so a start counts the moment a worker takes it) and whether
it takes new sessions (not draining, not full) on a `LoadBoard`:

- `FileLoadBoard` (file claims, one host): an 8-byte memory-mapped record per
  worker in ``<runtime dir>/load/<worker id>``. A write is a store into shared
  memory, a read a load from it: every worker sees every change at once.
- `RedisLoadBoard` (Redis claims, several hosts): one hash field per worker in
  ``gym_sessions:load``, written when the load changes (one write in flight,
  the latest value next) and read, for registered workers only, in one round
  trip per placement.

What a board says is advice, never authority: the chosen worker reserves room
itself and refuses with the private no-room mark when it is full or draining
(the sender then tries the next, and finally starts the session here), so no
start is lost and ``--max-sessions`` holds whatever a board says. Values are
not signed: whoever can write Redis can steer starts among genuine workers
(which only they can serve), not to anywhere else.

Herding: in a burst every acceptor would send to the same stale minimum. A
`Placement` therefore counts the starts it is delivering right now on top of
what each target published (`Placement.sending`) until the target's own count
includes them, breaks ties between other workers at random, and prefers
itself on a tie (no hop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio

from gym_sessions.errors import ClaimsUnavailableError
from gym_sessions.routing.keys import LOAD_KEY
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.redis_connection import call_redis
from gym_sessions.runtime_dir import worker_process_exists

__all__ = [
    "PLACED_SLACK",
    "PLACEMENTS",
    "PLACEMENT_ROUNDS",
    "FileLoadBoard",
    "LoadBoard",
    "Placement",
    "RedisLoadBoard",
    "WorkerLoad",
    "refuses_placed",
]

logger = logging.getLogger("gym_sessions.routing")

#: The values of ``--placement``.
PLACEMENTS = ("balanced", "local")

# A load record: the load, then flags (bit 0: takes new sessions).
_RECORD = struct.Struct("<II")
_ACCEPTING = 1
#: Offers of one start to other workers at most (each after a fresh read of
#: the loads) before it starts where it arrived.
PLACEMENT_ROUNDS = 3
#: How many sessions more than its sender believed a placed start's target
#: may hold and still take it (`refuses_placed`).
PLACED_SLACK = 2
# How often a reader asks again whether a worker whose record it reads still
# runs (a SIGKILLed worker leaves its record behind).
_ALIVE_CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class WorkerLoad:
    """What one worker published.

    Attributes:
        sessions: Live sessions plus starts under way there.
        accepting: It takes new sessions (not draining, not full).
    """

    sessions: int
    accepting: bool


class LoadBoard(Protocol):
    """Where workers publish their load and read each other's."""

    #: Seconds after a start's delivery until its target's record surely
    #: counts it (0: at once, as the target counts it before it replies).
    settle_seconds: float

    def publish(self, sessions: int, accepting: bool) -> None:
        """This worker's load changed (called synchronously, on every change)."""

    async def read(self) -> dict[str, WorkerLoad]:
        """The other workers' loads (this worker's own is read from memory).

        Raises:
            ClaimsUnavailableError: the board cannot be read (Redis).
        """

    async def close(self) -> None:
        """Withdraw this worker's record (it takes no more sessions)."""


class FileLoadBoard:
    """Load records as memory-mapped files in the runtime directory (one host).

    Args:
        directory: ``<runtime dir>/load`` (created if missing, mode 0700).
        worker_id: This worker's id (its record's name).
    """

    settle_seconds = 0.0

    def __init__(self, directory: str, worker_id: str) -> None:
        self.directory = directory
        self.worker_id = worker_id
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._path = os.path.join(directory, worker_id)
        # The record is written complete before it gets its name: a reader
        # never maps a short file.
        tmp = f"{self._path}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, _RECORD.pack(0, _ACCEPTING))
            self._own: mmap.mmap | None = mmap.mmap(fd, _RECORD.size)
        finally:
            os.close(fd)
        os.replace(tmp, self._path)
        # Other workers' records, mapped once each; and when each was last
        # found running.
        self._maps: dict[str, mmap.mmap] = {}
        self._alive: dict[str, tuple[float, bool]] = {}

    def publish(self, sessions: int, accepting: bool) -> None:
        if self._own is not None:
            _RECORD.pack_into(self._own, 0, sessions, _ACCEPTING if accepting else 0)

    async def read(self) -> dict[str, WorkerLoad]:
        return self.read_now()

    def read_now(self) -> dict[str, WorkerLoad]:
        """`read` without a coroutine (tests, benchmarks)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        loads = {}
        present = set()
        for name in names:
            if name == self.worker_id or name.endswith(".tmp"):
                continue
            present.add(name)
            record = self._map(name)
            if record is None or not self._running(name):
                continue
            sessions, flags = _RECORD.unpack_from(record, 0)
            loads[name] = WorkerLoad(sessions, bool(flags & _ACCEPTING))
        for gone in set(self._maps) - present:  # withdrawn: unmap
            self._maps.pop(gone).close()
            self._alive.pop(gone, None)
        return loads

    def _map(self, name: str) -> mmap.mmap | None:
        record = self._maps.get(name)
        if record is not None:
            return record
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            record = mmap.mmap(fd, _RECORD.size, access=mmap.ACCESS_READ)
        except (ValueError, OSError):
            return None  # not a record (too short): never placed on
        finally:
            os.close(fd)
        self._maps[name] = record
        return record

    def _running(self, worker_id: str) -> bool:
        now = time.monotonic()
        checked = self._alive.get(worker_id)
        if checked is None or now - checked[0] > _ALIVE_CHECK_SECONDS:
            checked = (now, worker_process_exists(worker_id))
            self._alive[worker_id] = checked
        return checked[1]

    async def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        if self._own is not None:
            self._own.close()
            self._own = None
        for record in self._maps.values():
            record.close()
        self._maps.clear()


# The loads of registered workers only: a field whose worker has no
# registration (exited, or cut off) is left out.
_READ_LOADS = """
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if redis.call('EXISTS', ARGV[1] .. all[i]) == 1 then
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
"""


class RedisLoadBoard:
    """Load records as fields of one Redis hash (several hosts).

    Args:
        client: The worker's Redis client (decoded replies).
        worker_id: This worker's id (its field).
        registration_prefix: Prefix of the workers' registration keys.
        deadline: Seconds one Redis call may take (`call_redis`).
    """

    key = LOAD_KEY
    # The target writes its new load one round trip after it counted the start
    # (its reply may come first): keep counting the start here a little longer.
    settle_seconds = 0.25

    def __init__(
        self, client: redis.asyncio.Redis, worker_id: str, registration_prefix: str, deadline: float
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.registration_prefix = registration_prefix
        self.deadline = deadline
        self._read_script = client.register_script(_READ_LOADS)
        self._value = _encode(0, True)
        self._written: str | None = None
        self._writer: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[dict[str, WorkerLoad]] | None = None
        self._closed = False

    def publish(self, sessions: int, accepting: bool) -> None:
        self._value = _encode(sessions, accepting)
        if self._closed or (self._writer is not None and not self._writer.done()):
            return  # the writer under way writes the latest value when it is done
        with contextlib.suppress(RuntimeError):  # no loop (a worker shutting down)
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._written != self._value and not self._closed:
                value = self._value
                await call_redis(self.client.hset(self.key, self.worker_id, value), self.deadline)
                self._written = value
        except ClaimsUnavailableError as exc:
            logger.debug("worker %s: load not published: %s", self.worker_id, exc)

    def republish(self) -> None:
        """Write the load again even if unchanged (Redis may have lost it); for the heartbeat."""
        self._written = None
        sessions, accepting = _decode(self._value)
        self.publish(sessions, accepting)

    async def read(self) -> dict[str, WorkerLoad]:
        # Concurrent placements share one round trip: a burst costs Redis one
        # read per round trip time, not one per start.
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(self._read_done)
        return await asyncio.shield(self._reading)

    def _read_done(self, _: object) -> None:
        self._reading = None

    async def _read(self) -> dict[str, WorkerLoad]:
        found = await call_redis(
            self._read_script(keys=[self.key], args=[self.registration_prefix]), self.deadline
        )
        loads = {}
        for worker_id, value in zip(found[::2], found[1::2], strict=True):
            if worker_id == self.worker_id:
                continue
            try:
                sessions, accepting = _decode(value)
            except ValueError:
                continue  # not a record this code wrote: never placed on
            loads[worker_id] = WorkerLoad(sessions, accepting)
        return loads

    async def close(self) -> None:
        self._closed = True
        if self._writer is not None:
            self._writer.cancel()
        with contextlib.suppress(ClaimsUnavailableError):
            await call_redis(self.client.hdel(self.key, self.worker_id), self.deadline)


def _encode(sessions: int, accepting: bool) -> str:
    return f"{sessions}|{1 if accepting else 0}"


def _decode(value: Any) -> tuple[int, bool]:
    sessions, _, flags = str(value).partition("|")
    if not sessions.isdigit() or flags not in ("0", "1"):
        raise ValueError(f"not a load record: {value!r}")
    return int(sessions), flags == "1"


def refuses_placed(claims: OwnedClaims, believed: bytes | None) -> bool:
    """Whether a start placed here (its `PLACED_MARK` value ``believed``) should go elsewhere.

    The sender chose this worker believing it held ``believed`` sessions; when
    it holds more than `PLACED_SLACK` beyond that, the sender's view was stale
    (many acceptors sent here at once): refuse, and the sender ranks afresh
    (`PLACEMENT_ROUNDS`) or starts the session itself. So a burst cannot pile
    onto one worker however late the loads are.
    """
    if believed is None or not believed.isdigit() or len(believed) > 9:
        return False  # not a placed start (or a mark this code never writes)
    return claims.load > int(believed) + PLACED_SLACK


class Placement:
    """Chooses the worker a new session starts on (``--placement balanced``).

    Args:
        claims: This worker's claims (its own load, read from memory).
        board: Every worker's published load.
        rng: Breaks ties between other workers (tests may pass a seeded one).
    """

    def __init__(
        self, claims: OwnedClaims, board: LoadBoard, rng: random.Random | None = None
    ) -> None:
        self.claims = claims
        self.board = board
        self._rng = rng or random.Random()
        # Starts this worker is delivering to each worker right now, and that
        # worker's record when the first of them left: until the hops return
        # (by then the target's own count has them) the target holds at least
        # that record plus these starts. Not the current record plus them: a
        # target counts a start as soon as it reads it, and counting it twice
        # would make this worker keep a burst's starts for itself.
        self._sending: Counter[str] = Counter()
        self._base: dict[str, int] = {}
        self._last: dict[str, int] = {}
        claims.on_count_change(self.publish)

    def publish(self) -> None:
        """Publish this worker's load now (also after draining begins)."""
        claims = self.claims
        self.board.publish(claims.load, claims.accepting_sessions and not claims.full)

    async def targets(self) -> list[tuple[str, int]]:
        """Other workers to offer a new session's start to, best first; ``[]``: start it here.

        Each with the sessions this worker believes it holds (the hop's
        `PLACED_MARK`: the target refuses when it holds clearly more,
        `refuses_placed`). Only workers that take new sessions and hold fewer
        than this worker does (all of them when this one takes none: draining
        or full). A board that cannot be read places nothing (the start stays here).
        """
        try:
            loads = await self.board.read()
        except ClaimsUnavailableError as exc:
            logger.debug("worker %s: loads unknown, starting here: %s", self.claims.worker_id, exc)
            return []
        # No await from here on: the choice and the caller's `sending` see one state.
        claims = self.claims
        here = claims.accepting_sessions and not claims.full
        mine = claims.load
        self._last = {worker: load.sessions for worker, load in loads.items()}
        ranked = sorted(
            (self._estimate(worker, load.sessions), self._rng.random(), worker)
            for worker, load in loads.items()
            if load.accepting
        )
        return [(worker, sessions) for sessions, _, worker in ranked if not here or sessions < mine]

    @contextlib.contextmanager
    def sending(self, worker_id: str) -> Iterator[None]:
        """Count a start being delivered to ``worker_id`` until the block ends."""
        if not self._sending[worker_id]:
            self._base[worker_id] = self._last.get(worker_id, 0)
        self._sending[worker_id] += 1
        try:
            yield
        finally:
            settle = self.board.settle_seconds
            if settle > 0:
                asyncio.get_running_loop().call_later(settle, self._sent, worker_id)
            else:
                self._sent(worker_id)

    def _sent(self, worker_id: str) -> None:
        self._sending[worker_id] -= 1
        if not self._sending[worker_id]:
            del self._sending[worker_id]
            self._base.pop(worker_id, None)

    def _estimate(self, worker_id: str, published: int) -> int:
        """What ``worker_id`` holds, counting the starts on their way there from here."""
        sending = self._sending.get(worker_id, 0)
        if not sending:
            return published
        return max(published, self._base.get(worker_id, 0) + sending)

    async def close(self) -> None:
        """Withdraw this worker's record: it takes no more starts."""
        await self.board.close()
