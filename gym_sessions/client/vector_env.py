"""`RemoteVectorEnv`: N remote sessions stepped concurrently from one process.

One asyncio event loop drives N `AsyncRemoteEnv` sessions; each `step`
sends their requests at once and waits for all replies. The calling thread
runs the loop itself, or, if it already runs an event loop of its own (a
notebook), a daemon thread does (`_VectorLoop`). No process per sub-env: the
work is the server's, the client only waits on sockets. ``gymnasium.make_vec``
builds it for ``gym_sessions/Remote-v0``.

Autoreset follows Gymnasium 1.x exactly as `gymnasium.vector.SyncVectorEnv`
does (``metadata["autoreset_mode"]``):

- ``NEXT_STEP`` (default): the step after a sub-env ends resets it, returning
  the first observation, reward 0 and no termination; its action is ignored.
- ``SAME_STEP``: a sub-env that ends is reset within the same step; the reply
  holds the new episode's first observation, and ``info["final_obs"]`` /
  ``info["final_info"]`` (masked by ``_final_obs`` / ``_final_info``) hold the end.
- ``DISABLED``: nothing resets by itself; reset ended sub-envs with
  ``reset(options={"reset_mask": mask})`` before stepping again.

Where the sessions live: by default each sub-env starts its session over its
own connection, one after another at its first start, so the server's
balanced placement (``--placement balanced``, its default) puts each on the
worker with the fewest sessions at that moment: 8 sub-envs on 4 idle workers
hold 2 each. A step then sends one ``/step_batch`` per holding worker, all at
once (`gym_sessions.client.step_batch`), so a CPU-heavy env steps on every
worker in parallel, and a worker's death takes only its own sub-envs.
``batch_group_size=N`` packs groups of N on one worker instead (one request
per group: cheaper for an env whose step costs less than a request).

A sub-env that fails stops the batch: `SessionGoneError` (its worker has
exited) names the sub-env in its message and in ``env_index``; other errors
carry ``env_index`` and a note. The other sub-envs may have stepped, so the
vector env refuses to step until a full `reset`, which also replaces lost
sessions with new ones.

A vector env that is garbage-collected or still open at interpreter exit
closes its sessions by itself, all at once on its loop (at most
`EXIT_CLOSE_TIMEOUT_SECONDS` in all, errors ignored), closes their
connections and closes its loop (and stops its thread, if any), so nothing is
left open on the server and no "Unclosed" warning is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from copy import deepcopy
from typing import Any, TypeVar

import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from gym_sessions.client import sigterm
from gym_sessions.client.async_remote_env import AsyncRemoteEnv
from gym_sessions.client.protocol import LIST_SUFFIX, EnvDescription
from gym_sessions.client.step_batch import StepBatch
from gym_sessions.client.tls import CertOption, VerifyOption, tls_context
from gym_sessions.errors import SessionGoneError
from gym_sessions.spaces.values import space_contains

__all__ = ["RemoteVectorEnv", "sub_env_info"]

T = TypeVar("T")

#: Seconds a vector env closing at garbage collection or exit waits for all its closes.
EXIT_CLOSE_TIMEOUT_SECONDS = 2.0

# Closes started on the loop's own thread, kept here until done (the loop only
# holds weak references to its tasks).
_CLOSING_TASKS: set[asyncio.Task[None]] = set()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _VectorLoop:
    """The vector env's own asyncio event loop; `run` blocks the caller until a coroutine ends.

    One loop for the env's life: the sessions' kept-alive connections belong
    to it and must outlive each call. A caller whose thread runs no event loop
    runs it itself (``run_until_complete``), so a vector step costs no switch
    between threads; a caller that already runs one (a notebook) cannot run
    another in its thread, so then the loop moves to a daemon thread of its
    own, for good, and `run` waits for it there. Against the loop always in a
    thread, the caller's thread measured 1.39x and 1.71x the steps/s at N = 4
    in two runs, and 0.98x at N = 64 (CartPole, 4 workers, interleaved rounds
    on 2 loaded cores; benchmarks/LOG.md): it pays where requests are few.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        # One caller drives the loop at a time (a collected env's close may come from any thread).
        self._lock = threading.Lock()
        self._close_after_run = False

    def is_current(self) -> bool:
        """Whether the caller runs inside this loop (where `run` would wait for itself)."""
        if self._thread is not None:
            return threading.current_thread() is self._thread
        return _running_loop() is self.loop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self.is_current():
            coroutine.close()
            raise RuntimeError("a vector env cannot wait for its own event loop from inside it")
        with self._lock:
            if self._thread is None:
                if _running_loop() is None:
                    return self._run_here(coroutine)
                self._thread = threading.Thread(
                    target=self.loop.run_forever, name="gym-sessions-vector-loop", daemon=True
                )
                self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupted caller must not leave requests running
            raise

    def _run_here(self, coroutine: Coroutine[Any, Any, T]) -> T:
        task = self.loop.create_task(coroutine)
        try:
            result = self.loop.run_until_complete(task)
            sigterm.exit_if_pending()  # a SIGTERM that came as the run ended
            return result
        except BaseException:
            # An interrupted caller (KeyboardInterrupt) must not leave requests
            # running: every task still pending here is this call's.
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for other in pending:
                other.cancel()
            if pending:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            raise
        finally:
            if self._close_after_run:
                self._close_here()

    def _close_here(self) -> None:
        """Close the loop from the caller's thread, once what it still runs has ended."""
        pending = asyncio.all_tasks(self.loop)
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=EXIT_CLOSE_TIMEOUT_SECONDS))
        self.loop.run_until_complete(asyncio.sleep(0))  # closed transports let their sockets go
        self.loop.close()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if self._thread is None:
            if self.loop.is_running():
                self._close_after_run = True  # stopped from inside a run: close once it ends
            else:
                with self._lock:
                    if not self.loop.is_closed():
                        self._close_here()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self.loop.close()


async def _gather(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    return await asyncio.gather(*calls, return_exceptions=True)


async def _close_envs(envs: Sequence[AsyncRemoteEnv], give_up_after: float | None) -> None:
    """Close every sub-env concurrently, ignoring their errors; give up after that many seconds."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_gather([env.close() for env in envs]), give_up_after)


def _close_and_stop(loop: _VectorLoop, envs: list[AsyncRemoteEnv], timeout: float | None) -> None:
    """Close every sub-env (see `_close_envs`) on ``loop``, then stop the loop."""
    if loop.loop.is_closed():
        return
    if loop.is_current():
        # Collected inside its own loop, which cannot wait for itself:
        # the loop closes the sessions, then stops.
        task = loop.loop.create_task(_close_envs(list(envs), timeout))
        _CLOSING_TASKS.add(task)
        task.add_done_callback(_CLOSING_TASKS.discard)
        task.add_done_callback(lambda _: loop.stop())
        return
    try:
        loop.run(_close_envs(list(envs), timeout))
    finally:
        loop.stop()


def _close_abandoned(pid: int, loop: _VectorLoop, envs: list[AsyncRemoteEnv]) -> None:
    """The close of a vector env collected or still open at exit: bounded, never raising."""
    if os.getpid() != pid:
        return  # a forked child has no loop of its own: its parent's sessions are not its own
    with contextlib.suppress(Exception):
        _close_and_stop(loop, envs, EXIT_CLOSE_TIMEOUT_SECONDS)


async def _one_by_one(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Await each call after the one before (errors returned, as `_gather` does)."""
    results: list[Any] = []
    for call in calls:
        try:
            results.append(await call())
        except Exception as error:
            results.append(error)
    return results


async def _step_then_reset(
    env: AsyncRemoteEnv,
    step: Awaitable[tuple[Any, float, bool, bool, dict[str, Any]]],
    max_steps: int | None,
    length: int,
) -> tuple[tuple[Any, float, bool, bool, dict[str, Any]], tuple[Any, dict[str, Any]] | None]:
    """SAME_STEP: step, and reset at once if the episode ended (or reached ``max_steps``)."""
    result = await step
    if result[2] or result[3] or (max_steps is not None and length + 1 >= max_steps):
        return result, await env.reset()
    return result, None


class RemoteVectorEnv(VectorEnv):
    """``num_envs`` sessions on a gym-sessions server, stepped concurrently.

    Example:
        >>> import gymnasium, gym_sessions
        >>> envs = gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=8, url=url)
        >>> obs, infos = envs.reset(seed=0)
        >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
        >>> envs.unwrapped.workers  # the server worker holding each session
        >>> envs.close()

    ``gymnasium.make_vec`` passes every keyword argument here; Gymnasium
    refuses ``vector_kwargs`` for an env with a vector entry point (CartPole's
    too), so: ``make_vec(id, num_envs=8, url=..., autoreset_mode="SameStep")``
    (docs/clients.md).

    Left open, it closes its sessions when garbage-collected or at interpreter
    exit (all at once, at most about 2 s, never raising; see the module).

    Args:
        num_envs: Number of sessions.
        url: The server's base URL.
        render_mode: As for `RemoteEnv`; `render` returns one frame per sub-env.
            A ``*_list`` mode (``rgb_array_list``) sessions render in the base
            mode after every reset and step, and `render` returns each
            sub-env's frames since its last `render` or reset, as
            ``gymnasium.make``'s ``RenderCollection`` collects them.
        timeout: Seconds to wait for each reply.
        retries: Resends of a request that is safe to resend after a lost reply.
        headers: Extra headers sent with every request of every sub-env (an
            authenticating proxy's, say: ``{"X-Proxy-Auth": "..."}``).
        verify: As for `RemoteEnv` (``https://`` URLs); one TLS context serves every sub-env.
        cert: As for `RemoteEnv` (``https://`` URLs).
        autoreset_mode: ``NEXT_STEP``, ``SAME_STEP`` or ``DISABLED`` (see the module).
        max_episode_steps: Truncate episodes after this many steps, counted here
            (as ``gymnasium.make(..., max_episode_steps=...)`` does with ``TimeLimit``).
        copy: Return copies of the batched observations, as ``SyncVectorEnv`` does.
        step_batch: Step the sub-envs with one ``POST /step_batch`` per worker
            holding some of them, when the server offers it (``/spaces``);
            ``False``: one ``/step`` per sub-env, as against an older server.
        batch_group_size: ``None`` (the default): spread the sessions over
            the server's workers. Each sub-env starts its session over its own
            connection, one after another at its first start (one round trip
            each, once), so balanced placement puts each on the worker with
            the fewest sessions (8 on 4 idle workers: 2 each); a step is one
            batch per holding worker, sent at once. A number: with batches,
            sub-envs ``k * size`` to ``(k + 1) * size - 1`` start their
            sessions over sub-env ``k * size``'s connection, so one worker
            holds the group and one request steps it (64: up to 64 sessions,
            one request per step). A request costs both sides far more than
            an entry, so packed groups step a cheap env faster, but one worker
            steps a group's entries in turn and its death takes the whole
            group; spread, a heavy env steps on every worker at once.
            ``1``: each sub-env starts over its own connection, all at once,
            wherever placement puts it.
        transport: ``"http"``, or ``"ws"``: each sub-env's session over its own
            WebSocket (`AsyncRemoteEnv`'s ``transport``); then no step batches
            (a batch names many sessions, a WebSocket one): one step message
            per sub-env, on the worker that holds it.
    """

    def __init__(
        self,
        num_envs: int = 1,
        url: str = "http://127.0.0.1:8000",
        render_mode: str | None = None,
        timeout: float = 60.0,
        retries: int = 1,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        max_episode_steps: int | None = None,
        copy: bool = True,
        headers: Mapping[str, str] | None = None,
        step_batch: bool = True,
        batch_group_size: int | None = None,
        verify: VerifyOption = True,
        cert: CertOption | None = None,
        transport: str = "http",
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be at least 1, not {num_envs}")
        if batch_group_size is not None and batch_group_size < 1:
            raise ValueError(f"batch_group_size must be at least 1, not {batch_group_size}")
        self.batch_group_size = batch_group_size
        self.num_envs = num_envs
        self.url = url
        self.render_mode = render_mode
        #: Frames of each sub-env since its last render or reset (``*_list`` modes only).
        self._frames: list[list[Any]] | None = None
        if render_mode is not None and render_mode.endswith(LIST_SUFFIX):
            render_mode = render_mode[: -len(LIST_SUFFIX)]
            self._frames = [[] for _ in range(num_envs)]
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.max_episode_steps = max_episode_steps
        self.copy = copy
        self._env_options: dict[str, Any] = {
            "timeout": timeout,
            "retries": retries,
            "render_mode": render_mode,
            "headers": headers,
            # Built once here: the sub-envs share its CA and certificate.
            "verify": tls_context(url, verify, cert) or verify,
            # This env closes its sub-envs at exit itself: all at once, on its loop.
            "close_at_exit": False,
            "transport": transport,
        }
        self._loop = _VectorLoop()
        #: One per sub-env; replaced in place (the exit close holds this list).
        self.envs: list[AsyncRemoteEnv] = []
        self._close_at_exit = weakref.finalize(
            self, _close_abandoned, os.getpid(), self._loop, self.envs
        )
        try:
            first = self._loop.run(AsyncRemoteEnv.create(url, **self._env_options))
        except BaseException:
            self._close_at_exit()
            raise
        self.description: EnvDescription = first.protocol.description
        #: The server's batch route, if used (see ``step_batch``).
        self.step_batch = (
            self.description.step_batch if step_batch and transport == "http" else None
        )
        self.envs += [first] + [self._new_env() for _ in range(num_envs - 1)]
        for i in range(num_envs):
            self._start_in_group(i)

        self.metadata = {**self.description.metadata, "autoreset_mode": self.autoreset_mode}
        self._spec: EnvSpec | None = None
        self.single_observation_space = self.description.observation_space
        self.single_action_space = self.description.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)

        self._env_obs: list[Any] = [None] * num_envs
        self._observations: Any = create_empty_array(
            self.single_observation_space, num_envs, np.zeros
        )
        self._rewards = np.zeros((num_envs,), dtype=np.float64)
        self._terminations = np.zeros((num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((num_envs,), dtype=np.bool_)
        self._autoreset_envs = np.zeros((num_envs,), dtype=np.bool_)
        self._episode_lengths = np.zeros((num_envs,), dtype=np.int64)
        self._lost = np.zeros((num_envs,), dtype=np.bool_)
        self._needs_reset = True

    def _new_env(self) -> AsyncRemoteEnv:
        return AsyncRemoteEnv(self.url, description=self.description, **self._env_options)

    def _start_in_group(self, i: int) -> None:
        """With batches: sub-env ``i`` starts its sessions over its group leader's connection."""
        if self.batch_group_size is None:
            return  # spread: each over its own (`reset` starts them one by one)
        leader = i - i % self.batch_group_size
        if self.step_batch is not None and leader != i:
            self.envs[i].starts_over = self.envs[leader]

    @property
    def spec(self) -> EnvSpec | None:
        """The spec ``gymnasium.make_vec`` gave, with the served env's episode limits.

        As `RemoteEnv.spec` (`EnvDescription.local_spec`).
        """
        return self._spec

    @spec.setter
    def spec(self, spec: EnvSpec | None) -> None:
        self._spec = self.description.local_spec(spec)

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """Each sub-env's seed (``(42, 43, ...)`` after ``reset(seed=42)``), as in Sync."""
        return tuple(env.np_random_seed for env in self.envs)

    @property  # type: ignore[override]
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Each sub-env's generator, seeded by ``reset(seed=...)``, as ``SyncVectorEnv``."""
        return tuple(env.np_random for env in self.envs)

    @np_random.setter
    def np_random(self, value: Any) -> None:
        raise AttributeError("a vector env's generators are its sub-envs': seed them by reset")

    # Sub-env calls ---------------------------------------------------------------------------

    def _call_all(self, calls: Sequence[tuple[int, Awaitable[Any]]]) -> list[Any]:
        """Await ``calls`` (sub-env index, awaitable) concurrently; raise the first failure."""
        results = self._loop.run(_gather([call for _, call in calls]))
        return self._checked([index for index, _ in calls], results)

    def _checked(self, indices: Sequence[int], results: list[Any]) -> list[Any]:
        """``results`` of the sub-envs at ``indices``; raises the first that is a failure."""
        failed = [
            (index, result)
            for index, result in zip(indices, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failed:
            self._needs_reset = True
            for index, result in failed:
                if isinstance(result, SessionGoneError):
                    self._lost[index] = True
            raise self._sub_env_error(*failed[0], others=[index for index, _ in failed[1:]])
        return results

    def _sub_env_error(self, index: int, error: BaseException, others: list[int]) -> BaseException:
        env = self.envs[index]
        where = f"sub-env {index} (session {env.session_id}, worker {env.worker})"
        also = f"; sub-envs {others} failed too" if others else ""
        if isinstance(error, SessionGoneError):
            gone = SessionGoneError(f"{where} lost its session: {error.message}{also}")
            gone.__cause__ = error
            error = gone
        else:
            error.add_note(f"raised by {where}{also}")
        error.env_index = index  # type: ignore[attr-defined]
        return error

    # Gymnasium API -----------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (or those in ``options["reset_mask"]``), as ``SyncVectorEnv``."""
        sigterm.stop_if_terminated()
        sigterm.hold(self)  # here too: the sub-envs may reset in the loop's own thread
        if isinstance(seed, int):
            seeds: list[int | None] = [seed + i for i in range(self.num_envs)]
        else:
            seeds = [None] * self.num_envs if seed is None else list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} "
                f"but got length={len(seeds)}."
            )
        options = dict(options) if options is not None else None
        mask = _reset_mask(options, self.num_envs)
        if mask is None:
            mask = np.ones((self.num_envs,), dtype=np.bool_)
            self._needs_reset = False
        indices = [int(i) for i in np.flatnonzero(mask)]
        self._replace_lost(indices)
        self._terminations[mask] = False
        self._truncations[mask] = False
        self._autoreset_envs[mask] = False
        self._episode_lengths[mask] = 0

        # A group's new sessions start beside its leader's (`AsyncRemoteEnv.reset`),
        # which needs the leader's cookie: leaders' starts go first. Spread, new
        # sessions start one after another: each start's placement then counts
        # the ones before it (at once they could all see the same least busy worker).
        beside = [i for i in indices if self.envs[i].starts_beside_leader]
        spread = self.batch_group_size is None
        one_by_one = [i for i in indices if spread and self.envs[i].starts_session]
        later = {*beside, *one_by_one}
        at_once = [i for i in indices if i not in later]
        replies: dict[int, tuple[Any, dict[str, Any]]] = {}
        for phase in (at_once, beside):
            if phase:
                calls = [(i, self.envs[i].reset(seed=seeds[i], options=options)) for i in phase]
                replies.update(zip(phase, self._call_all(calls), strict=True))
        if one_by_one:
            starts = [
                functools.partial(self.envs[i].reset, seed=seeds[i], options=options)
                for i in one_by_one
            ]
            started = self._checked(one_by_one, self._loop.run(_one_by_one(starts)))
            replies.update(zip(one_by_one, started, strict=True))
        infos: dict[str, Any] = {}
        for i in indices:
            observation, info = replies[i]
            self._env_obs[i] = observation
            infos = self._add_info(infos, info, i)
        self._collect_frames(indices, restarted=indices)
        return self._batched_observations(), infos

    def _replace_lost(self, indices: list[int]) -> None:
        lost = [i for i in indices if self._lost[i]]
        if not lost:
            return
        self._loop.run(_gather([self.envs[i].close() for i in lost]))
        for i in lost:
            self.envs[i] = self._new_env()
        for i in range(self.num_envs):  # a new leader's group follows it
            self._start_in_group(i)
            self._lost[i] = False

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env concurrently; autoreset as ``metadata["autoreset_mode"]`` says."""
        sigterm.stop_if_terminated()
        if self._needs_reset:
            raise RuntimeError("call reset() first (after creation or after a sub-env failed)")
        mode = self.autoreset_mode
        if mode == AutoresetMode.DISABLED and self._autoreset_envs.any():
            ended = np.flatnonzero(self._autoreset_envs).tolist()
            raise RuntimeError(
                f"sub-envs {ended} have ended and autoreset is disabled: reset them with "
                "reset(options={'reset_mask': mask})"
            )
        sub_env_actions = self._sub_env_actions(actions)
        restarted = [
            i
            for i in range(self.num_envs)
            if mode == AutoresetMode.NEXT_STEP and self._autoreset_envs[i]
        ]
        if self.step_batch is not None and self.num_envs > 1:
            results = self._checked(
                range(self.num_envs), self._loop.run(self._batched(sub_env_actions))
            )
        else:
            calls: list[tuple[int, Awaitable[Any]]] = []
            for i, action in enumerate(sub_env_actions):
                env = self.envs[i]
                if mode == AutoresetMode.NEXT_STEP and self._autoreset_envs[i]:
                    calls.append((i, env.reset()))
                elif mode == AutoresetMode.SAME_STEP:
                    length = int(self._episode_lengths[i])
                    calls.append(
                        (i, _step_then_reset(env, env.step(action), self.max_episode_steps, length))
                    )
                else:
                    calls.append((i, env.step(action)))
            results = self._call_all(calls)

        infos: dict[str, Any] = {}
        for i, result in enumerate(results):
            if mode == AutoresetMode.NEXT_STEP and self._autoreset_envs[i]:
                self._env_obs[i], info = result
                self._rewards[i] = 0.0
                self._terminations[i] = self._truncations[i] = False
                self._episode_lengths[i] = 0
            elif mode == AutoresetMode.SAME_STEP:
                (observation, reward, terminated, truncated, info), restart = result
                self._record_step(i, observation, reward, terminated, truncated)
                if restart is not None:
                    restarted.append(i)
                    final = {"final_obs": self._env_obs[i], "final_info": info}
                    infos = self._add_info(infos, final, i)
                    self._env_obs[i], info = restart
                    self._episode_lengths[i] = 0
            else:
                self._record_step(i, *result[:4])
                info = result[4]
            infos = self._add_info(infos, info, i)
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        self._collect_frames(range(self.num_envs), restarted=restarted)
        return (
            self._batched_observations(),
            np.copy(self._rewards),
            np.copy(self._terminations),
            np.copy(self._truncations),
            infos,
        )

    def _sub_env_actions(self, actions: Any) -> list[Any]:
        """Each sub-env's action of the batch ``actions``, all checked before any is sent.

        Raises:
            ValueError: ``actions`` holds another number of actions than
                ``num_envs``, or one outside ``single_action_space`` (its
                ``env_index`` names the first such sub-env). Nothing was sent:
                the vector env steps on as before.
        """
        try:
            split = list(iterate(self.action_space, actions))
        except (TypeError, IndexError, KeyError, ValueError) as exc:
            raise ValueError(
                f"actions must be a batch of {self.num_envs} actions of "
                f"{self.single_action_space} (an element of action_space), "
                f"got {type(actions).__name__}: {exc}"
            ) from exc
        if len(split) != self.num_envs:
            raise ValueError(
                f"actions must hold one action per sub-env ({self.num_envs}), got {len(split)}"
            )
        for i, action in enumerate(split):
            if not space_contains(self.single_action_space, action):
                error = ValueError(
                    f"the action of sub-env {i}, {action!r}, is outside the action space "
                    f"{self.single_action_space}; no sub-env stepped"
                )
                error.env_index = i  # type: ignore[attr-defined]
                raise error
        return split

    async def _batched(self, sub_env_actions: list[Any]) -> list[Any]:
        """One vector step through the step batches: each sub-env's result, as `step` reads them.

        The same results as the per-sub-env calls of `step`: NEXT_STEP resets
        run beside the batches; SAME_STEP resets the sub-envs that ended once
        the batches are in (a step and its reset, as `_step_then_reset`).
        """
        assert self.step_batch is not None
        mode = self.autoreset_mode
        resetting = (
            [int(i) for i in np.flatnonzero(self._autoreset_envs)]
            if mode == AutoresetMode.NEXT_STEP
            else []
        )
        stepping = {i: action for i, action in enumerate(sub_env_actions) if i not in resetting}
        batch = StepBatch(
            self.envs, stepping, self.step_batch["path"], self.step_batch["max_entries"]
        )
        if resetting:
            stepped, *reset = await asyncio.gather(
                batch.run(), *(self.envs[i].reset() for i in resetting), return_exceptions=True
            )
        else:  # awaited in this task: no task of its own, a loop turn less
            stepped, reset = await batch.run(), []
        if isinstance(stepped, BaseException):
            raise stepped  # never a sub-env's error: those are its results
        results: list[Any] = [None] * self.num_envs
        for i, result in zip(resetting, reset, strict=True):
            results[i] = result
        for i, result in stepped.items():
            results[i] = result
        if mode != AutoresetMode.SAME_STEP:
            return results
        limit = self.max_episode_steps
        ended = [
            i
            for i in stepping
            if not isinstance(results[i], BaseException)
            and (
                results[i][2]
                or results[i][3]
                or (limit is not None and self._episode_lengths[i] + 1 >= limit)
            )
        ]
        restarts = await _gather([self.envs[i].reset() for i in ended])
        restart_of = dict(zip(ended, restarts, strict=True))
        for i in stepping:
            if isinstance(results[i], BaseException):
                continue
            restart = restart_of.get(i)
            results[i] = restart if isinstance(restart, BaseException) else (results[i], restart)
        return results

    def _record_step(
        self, i: int, observation: Any, reward: float, terminated: bool, truncated: bool
    ) -> None:
        self._episode_lengths[i] += 1
        limit = self.max_episode_steps
        if limit is not None and self._episode_lengths[i] >= limit:
            truncated = True
        self._env_obs[i] = observation
        self._rewards[i] = reward
        self._terminations[i] = terminated
        self._truncations[i] = truncated

    def _batched_observations(self) -> Any:
        self._observations = concatenate(
            self.single_observation_space, self._env_obs, self._observations
        )
        return deepcopy(self._observations) if self.copy else self._observations

    def render(self) -> tuple[Any, ...]:
        """One frame per sub-env, fetched concurrently (``None`` each without a render mode).

        In a ``*_list`` mode: each sub-env's list of frames since its last
        `render` or reset, emptied, as ``SyncVectorEnv`` of ``RenderCollection`` envs.
        """
        if self._frames is not None:
            frames = tuple(self._frames)
            self._frames = [[] for _ in range(self.num_envs)]
            return frames
        return tuple(self._call_all([(i, env.render()) for i, env in enumerate(self.envs)]))

    def _collect_frames(self, indices: Iterable[int], restarted: Sequence[int]) -> None:
        """``*_list`` modes: each sub-env's frame after a reset or step (a reset drops older)."""
        if self._frames is None:
            return
        chosen = list(indices)
        frames = self._call_all([(i, self.envs[i].render()) for i in chosen])
        for i, frame in zip(chosen, frames, strict=True):
            if i in restarted:
                self._frames[i] = []
            self._frames[i].append(frame)

    # Sub-env attributes ------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str | None, ...]:
        """The server worker holding each sub-env's session (known after the first reset)."""
        return tuple(env.worker for env in self.envs)

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Each sub-env's session id."""
        return tuple(env.session_id for env in self.envs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """An attribute of every sub-env's local proxy (`AsyncRemoteEnv`).

        Raises:
            AttributeError: The proxy has none: the served env's own
                attributes (``gravity``, say) live on the server.
        """
        return tuple(_proxy_attribute(env, name) for env in self.envs)

    def set_attr(self, name: str, values: Any) -> None:
        """Always refused: a value set on a local proxy would never reach the served env.

        Raises:
            AttributeError: Always; configure the served env with ``gym-sessions
                serve ... --env-kwargs`` or reset options.
        """
        raise AttributeError(
            f"cannot set {name!r} on remote sub-envs: the served env lives on the server; "
            "configure it with `gym-sessions serve ... --env-kwargs '{...}'` or reset options"
        )

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call a method of every sub-env, awaiting coroutine methods concurrently."""
        return self.call_on(range(self.num_envs), name, *args, **kwargs)

    def call_on(
        self, indices: Iterable[int], name: str, *args: Any, **kwargs: Any
    ) -> tuple[Any, ...]:
        """Call a method of the sub-envs at ``indices`` (in that order), as `call` does.

        Example:
            >>> envs.unwrapped.call_on([0, 2], "verify")  # /verify of sub-envs 0 and 2
        """
        chosen = list(indices)
        results = [_proxy_attribute(self.envs[i], name)(*args, **kwargs) for i in chosen]
        pending = [(k, r) for k, r in enumerate(results) if asyncio.iscoroutine(r)]
        awaited = self._call_all([(chosen[k], r) for k, r in pending])
        for (k, _), value in zip(pending, awaited, strict=True):
            results[k] = value
        return tuple(results)

    def close_extras(self, **kwargs: Any) -> None:
        """Close every session (best effort, concurrently), then the event loop."""
        try:
            if self._close_at_exit.detach() is not None:
                _close_and_stop(self._loop, self.envs, timeout=None)
        finally:
            sigterm.release(self)


def _proxy_attribute(env: AsyncRemoteEnv, name: str) -> Any:
    """``env.name``, or an `AttributeError` that says where the served env's attributes are."""
    try:
        return getattr(env, name)
    except AttributeError:
        raise AttributeError(
            f"remote sub-envs have no attribute {name!r}: the served env's own attributes "
            "and methods live on the server, out of reach over HTTP (sub-envs have url, "
            "render_mode, metadata, the spaces, session_id, worker, np_random, np_random_seed, "
            "and the methods render and verify)"
        ) from None


def sub_env_info(infos: dict[str, Any], index: int) -> dict[str, Any]:
    """Sub-env ``index``'s part of a vector env's merged info dict (undoes ``_add_info``).

    Keys whose ``_key`` mask is false for ``index`` are left out; nested dicts
    (``final_info``) are split the same way. Values come back as the merged
    arrays hold them (``np.int64`` for an int, say).

    Example:
        >>> obs, infos = envs.reset(seed=0)
        >>> sub_env_info(infos, 3)  # what sub-env 3's own reset returned as info
    """
    info: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        if mask is not None and not mask[index]:
            continue
        info[key] = sub_env_info(value, index) if isinstance(value, dict) else value[index]
    return info


def _reset_mask(options: dict[str, Any] | None, num_envs: int) -> np.ndarray | None:
    """Pop and check ``options["reset_mask"]`` as ``SyncVectorEnv`` does."""
    if options is None or "reset_mask" not in options:
        return None
    mask = options.pop("reset_mask")
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            f"value, got reset_mask={mask}"
        )
    return mask
