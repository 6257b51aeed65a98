"""A client process stopped with SIGTERM closes its sessions as on Ctrl-C, leaving handlers be.

Real child processes step envs on a real 2-worker server (one for the module) and get SIGTERM (what
``kill``, Slurm and Kubernetes send): each exits with status 143 quietly and
leaves no session open. A handler of the application's own, installed before
the first session, stays in place and runs; one installed after it that chains
to the handler it replaced reaches the client's; a process whose envs are
all closed, and a forked child, die by the signal as before. In this process:
the handler is there only while a session is open in the main thread.
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable, Iterator

import gymnasium as gym
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import RemoteEnv, sigterm
from tests.e2e.test_client_lifecycle import (
    STEPS_UNTIL_INTERRUPTED,
    Child,
    assert_no_leak_printed,
    live_sessions,
    settled_sessions,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # signals

COUNTER = "envs.counter:CounterEnv"


@pytest.fixture
def children() -> Iterator[Callable[[str, str], Child]]:
    started: list[Child] = []

    def start(script: str, url: str) -> Child:
        started.append(Child(script, url))
        return started[-1]

    yield start
    for child in started:
        child.kill()


# The application's own SIGTERM handler, before the first session: it runs, not the client's.
OWN_HANDLER_FIRST = r"""
import signal, sys, gym_sessions
from gym_sessions.client import RemoteEnv

def on_term(signum, frame):
    print("own handler", flush=True)
    sys.exit(3)

signal.signal(signal.SIGTERM, on_term)
env = RemoteEnv(sys.argv[1])
env.reset()
assert signal.getsignal(signal.SIGTERM) is on_term
print("ready", 1, flush=True)
while True:
    env.step(1)
"""

# A handler installed after the first session that chains to the one it replaced.
CHAINING_HANDLER_AFTER = r"""
import signal, sys, gym_sessions
from gym_sessions.client import RemoteEnv

env = RemoteEnv(sys.argv[1])
env.reset()

def on_term(signum, frame):
    print("own handler", flush=True)
    replaced(signum, frame)

replaced = signal.signal(signal.SIGTERM, on_term)
print("ready", 1, flush=True)
while True:
    env.step(1)
"""

# Every env closed: SIGTERM has its default again.
CLOSED_BEFORE = r"""
import sys, time, gymnasium, gym_sessions
from gym_sessions.client import RemoteEnv

env = RemoteEnv(sys.argv[1])
env.reset()
env.close()
envs = gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=2, url=sys.argv[1])
envs.reset()
envs.close()
print("ready", 0, flush=True)
time.sleep(60)
"""

# SIGTERM lands in a finalizer, where Python only prints its SystemExit: the next step ends it.
SWALLOWED_IN_A_FINALIZER = r"""
import os, signal, sys, gym_sessions
from gym_sessions.client import RemoteEnv

class SignalledWhileCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the finalizer
            pass

env = RemoteEnv(sys.argv[1])
env.reset()
SignalledWhileCollected()
print("ready", 1, flush=True)
while True:
    env.step(1)
"""

# A forked child of a process with open sessions: dies by the signal.
FORKED_CHILD = r"""
import multiprocessing, sys, time, gym_sessions
from gym_sessions.client import RemoteEnv

env = RemoteEnv(sys.argv[1])
env.reset()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
time.sleep(0.5)
child.terminate()
child.join(10)
print("ready", 1, flush=True)
sys.stdin.readline()
print("child exit", child.exitcode, flush=True)
"""


@pytest.mark.parametrize("client", sorted(STEPS_UNTIL_INTERRUPTED))
def test_a_process_stopped_by_sigterm_mid_episode_closes_its_sessions(
    module_serve, children, client
):
    server = module_serve(COUNTER, workers=2)
    child = children(STEPS_UNTIL_INTERRUPTED[client], server.url)
    held = child.wait_ready()
    assert live_sessions(server, 2) == held
    time.sleep(0.3)  # stepping
    child.process.send_signal(signal.SIGTERM)
    code, stderr = child.finish()
    assert code == sigterm.EXIT_STATUS == 143, stderr
    assert stderr.strip() == ""
    assert settled_sessions(server, 2, 0) == 0


def test_a_sigterm_a_finalizer_swallowed_still_ends_the_loop_at_its_next_step(
    module_serve, children
):
    server = module_serve(COUNTER, workers=2)
    child = children(SWALLOWED_IN_A_FINALIZER, server.url)
    child.wait_ready()
    code, stderr = child.finish()
    assert "Exception ignored" in stderr and "SystemExit: 143" in stderr  # where it landed
    assert code == 143, stderr
    assert settled_sessions(server, 2, 0) == 0


def test_the_applications_own_handler_stays_and_runs(module_serve, children):
    server = module_serve(COUNTER, workers=2)
    child = children(OWN_HANDLER_FIRST, server.url)
    child.wait_ready()
    time.sleep(0.3)
    child.process.send_signal(signal.SIGTERM)
    stdout, stderr = child.process.communicate(timeout=60)
    assert child.process.returncode == 3, stderr
    assert stdout.strip() == "own handler"
    assert_no_leak_printed(stderr)
    assert settled_sessions(server, 2, 0) == 0  # sys.exit closed them, as any exit does


def test_a_handler_installed_later_that_chains_reaches_the_clients(module_serve, children):
    server = module_serve(COUNTER, workers=2)
    child = children(CHAINING_HANDLER_AFTER, server.url)
    child.wait_ready()
    time.sleep(0.3)
    child.process.send_signal(signal.SIGTERM)
    stdout, stderr = child.process.communicate(timeout=60)
    assert child.process.returncode == 143, stderr
    assert stdout.strip() == "own handler"
    assert settled_sessions(server, 2, 0) == 0


def test_with_every_env_closed_sigterm_kills_as_before(module_serve, children):
    server = module_serve(COUNTER, workers=2)
    child = children(CLOSED_BEFORE, server.url)
    assert child.wait_ready() == 0
    child.process.send_signal(signal.SIGTERM)
    code, _ = child.finish()
    assert code == -signal.SIGTERM


def test_a_forked_child_dies_by_the_signal_and_the_parent_keeps_its_session(module_serve, children):
    server = module_serve(COUNTER, workers=2)
    child = children(FORKED_CHILD, server.url)
    child.wait_ready()
    assert live_sessions(server, 2) == 1
    stdout, stderr = child.process.communicate("\n", timeout=60)
    assert child.process.returncode == 0, stderr
    assert stdout.strip() == f"child exit {-signal.SIGTERM}"
    assert settled_sessions(server, 2, 0) == 0


def test_the_handler_is_there_only_while_a_session_is_open_in_the_main_thread(module_serve):
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    server = module_serve(COUNTER, workers=2)
    env = RemoteEnv(server.url)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # no session yet
    env.reset()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    envs = gym.make_vec("gym_sessions/Remote-v0", num_envs=2, url=server.url)
    envs.reset()
    env.close()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the vector env's are open
    envs.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    env.reset()  # a new session after close(): held again
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    env.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    dropped = RemoteEnv(server.url)
    dropped.reset()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    del dropped
    gc.collect()  # collected without close(): its session closes, the handler goes
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    in_thread = RemoteEnv(server.url)
    worker = threading.Thread(target=in_thread.reset)
    worker.start()
    worker.join(30)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # only the main thread may set it
    in_thread.close()
    assert live_sessions(server, 2) == 0
