"""Start-up cost of a Python REPL interpreter (`envs.python_repl`), sandboxed vs unsandboxed.

Two 1-worker servers run side by side: one sandboxed (the default as root:
a leased uid, ``prlimit`` and ``setpriv``), one with ``--unsandboxed``. Each
round, in rotating order, every server gets a fresh session (a ``run_code``
without a cookie, over one kept-alive connection) whose first call is the
trivial ``pass``: its latency, request to reply, includes starting the
interpreter. A second ``pass`` on the same session is the warm baseline; the
start-up cost is the first call minus the warm one. The session is then
closed and the script waits 0.1 s, so a session's teardown (killing its uid,
removing its directory, in a worker thread) does not overlap the next start.

A last section times the commands alone (``subprocess.run``, no server):
``python -I -c pass`` as it is, under ``prlimit`` only, and under ``prlimit``
and ``setpriv`` as a session runs, to show what the util-linux wrappers cost.

Needs root (the sandbox does).

    .venv/bin/python benchmarks/repl_start.py [--rounds 40]

Prints Markdown tables; writes repl_start.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import _common
from _common import RawConnection, markdown_table, session_cookie, summary

from envs.python_repl import PythonReplServer
from envs.repl_sandbox import PROBE_UID, SANDBOX_PATH
from gym_sessions.server.process import ServerProcess, start_server

TARGET = "envs.python_repl:PythonReplServer"
SETTLE_SECONDS = 0.1
BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
PYTHON_ENV = "REPL_START_PYTHON"
# Served as repl_start:SAME_PYTHON_REPL (benchmarks/ on the server's PYTHONPATH): an
# unsandboxed server running the sandbox's Python, when that is not the worker's own.
SAME_PYTHON_REPL = PythonReplServer(python=os.environ.get(PYTHON_ENV) or None)


class Mode:
    """One server to measure: its target, arguments and environment."""

    def __init__(
        self, name: str, target: str, args: tuple[str, ...], env: dict[str, str] | None = None
    ) -> None:
        self.name, self.target, self.args, self.env = name, target, args, env


def modes(sandbox_python: str) -> list[Mode]:
    """Sandboxed, unsandboxed, and unsandboxed with the sandbox's Python if it differs."""
    found = [
        Mode("sandboxed", TARGET, ()),
        Mode("unsandboxed", TARGET, ("--unsandboxed",)),
    ]
    if sandbox_python != sys.executable:
        env = {"PYTHONPATH": BENCHMARKS, PYTHON_ENV: sandbox_python}
        name = f"unsandboxed, {sandbox_python}"
        found.append(Mode(name, "repl_start:SAME_PYTHON_REPL", ("--unsandboxed",), env))
    return found


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def stats_ms(values: list[float]) -> dict[str, float]:
    """`summary` of ``values`` (seconds) in milliseconds."""
    return {key: value if key == "n" else ms(value) for key, value in summary(values).items()}


def timed_call(
    connection: RawConnection, cookie: str | None
) -> tuple[float, str | None, dict[str, Any]]:
    """One ``run_code pass``: seconds from request to reply, the session cookie, the reply."""
    headers = {"Cookie": f"{_common.COOKIE}={cookie}"} if cookie else {}
    began = time.perf_counter()
    status, data, response = connection.request(
        "POST", "/run_code", {"code": "pass"}, headers=headers
    )
    elapsed = time.perf_counter() - began
    if status != 200 or data.get("error"):
        raise RuntimeError(f"run_code failed: {status} {data}")
    return elapsed, cookie or session_cookie(response), data


def one_session(connection: RawConnection) -> tuple[float, float]:
    """A fresh session's first call and its second (warm) call, in seconds; then its close."""
    first, cookie, _ = timed_call(connection, None)
    if cookie is None:
        raise RuntimeError("the first reply set no session cookie")
    warm, _, _ = timed_call(connection, cookie)
    status, data, _ = connection.request(
        "POST", "/close_session", {}, headers={"Cookie": f"{_common.COOKIE}={cookie}"}
    )
    if status != 200 or data["outcome"] != "closed":
        raise RuntimeError(f"close failed: {status} {data}")
    return first, warm


def measure_servers(rounds: int, measured: list[Mode]) -> dict[str, dict[str, list[float]]]:
    """Per mode: first-call, warm-call and start-up (first - warm) seconds of every round."""
    servers: dict[str, ServerProcess] = {}
    connections: dict[str, RawConnection] = {}
    samples: dict[str, dict[str, list[float]]] = {
        mode.name: {"first": [], "warm": [], "startup": []} for mode in measured
    }
    try:
        for mode in measured:
            servers[mode.name] = start_server(mode.target, *mode.args, env=mode.env)
            connections[mode.name] = RawConnection(servers[mode.name].url)
        for name in samples:  # warm the servers up (imports, the first thread of the pool)
            one_session(connections[name])
        order = list(samples)
        for number in range(rounds):
            turn = number % len(order)
            for mode in order[turn:] + order[:turn]:
                first, warm = one_session(connections[mode])
                samples[mode]["first"].append(first)
                samples[mode]["warm"].append(warm)
                samples[mode]["startup"].append(first - warm)
                time.sleep(SETTLE_SECONDS)
    finally:
        for connection in connections.values():
            connection.close()
        for server in servers.values():
            server.stop()
    return samples


def wrapper_commands() -> dict[str, list[str]]:
    """``python -I -c pass`` bare, under prlimit, and under prlimit + setpriv as a session."""
    sandbox = PythonReplServer().sandbox
    sandbox.configure(unsandboxed=False)
    limits = sandbox.limits
    python = [sandbox.python, "-I", "-c", "pass"]
    setpriv = [
        sandbox.setpriv,
        f"--reuid={PROBE_UID}",
        f"--regid={PROBE_UID}",
        "--clear-groups",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--pdeathsig=KILL",
        "--",
    ]
    prlimit = [sandbox.prlimit, *limits.prlimit_options(per_uid_processes=True), "--"]
    return {
        "python -I -c pass": python,
        "prlimit + python": [*prlimit, *python],
        "prlimit + setpriv + python": [*prlimit, *setpriv, *python],
    }


def measure_commands(rounds: int) -> dict[str, list[float]]:
    """Seconds to run each command of `wrapper_commands` to its exit, interleaved."""
    commands = wrapper_commands()
    samples: dict[str, list[float]] = {name: [] for name in commands}
    env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}
    for _ in range(rounds):
        for name, command in commands.items():
            began = time.perf_counter()
            subprocess.run(command, env=env, cwd="/", check=True)
            samples[name].append(time.perf_counter() - began)
    return samples


def server_table(samples: dict[str, dict[str, list[float]]]) -> str:
    rows = []
    for mode, kinds in samples.items():
        for kind, label in (
            ("first", "first call (starts it)"),
            ("warm", "second call"),
            ("startup", "start-up (first - second)"),
        ):
            stats = summary(kinds[kind])
            rows.append([mode, label, ms(stats["p50"]), ms(stats["p90"]), ms(stats["max"])])
    return markdown_table(["mode", "latency", "p50 ms", "p90 ms", "max ms"], rows)


def command_table(samples: dict[str, list[float]]) -> str:
    rows = []
    for name, values in samples.items():
        stats = summary(values)
        rows.append([name, ms(stats["p50"]), ms(stats["p90"])])
    return markdown_table(["command", "p50 ms", "p90 ms"], rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = _common.parse_args(parser)
    if os.geteuid() != 0:
        print("repl_start.py: the sandbox needs root; run it as root", file=sys.stderr)
        return 2
    print(_common.load_note())
    machine = _common.machine()
    sandbox = PythonReplServer().sandbox
    sandbox.configure(unsandboxed=False)
    measured = modes(sandbox.python)
    servers = measure_servers(args.rounds, measured)
    commands = measure_commands(args.rounds)
    baseline = measured[-1].name  # unsandboxed with the same Python as the sandbox
    extra = [
        a - b
        for a, b in zip(servers["sandboxed"]["startup"], servers[baseline]["startup"], strict=True)
    ]
    print("\nrun_code on a fresh session, 1 worker each, interleaved rounds\n")
    print(server_table(servers))
    print(
        f"\nsandbox extra start-up per interpreter over {baseline!r} (median of per-round "
        f"differences): {ms(statistics.median(extra))} ms"
    )
    print("\nthe commands alone (subprocess.run to exit)\n")
    print(command_table(commands))
    path = _common.write_json(
        "repl_start",
        {
            "machine": machine,
            "rounds": args.rounds,
            "settle_seconds": SETTLE_SECONDS,
            "servers_ms": {
                mode: {kind: stats_ms(values) for kind, values in kinds.items()}
                for mode, kinds in servers.items()
            },
            "sandbox_python": sandbox.python,
            "sandbox_extra_startup_baseline": baseline,
            "sandbox_extra_startup_ms_median": ms(statistics.median(extra)),
            "commands_ms": {name: stats_ms(values) for name, values in commands.items()},
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
