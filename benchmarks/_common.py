"""Shared plumbing of the benchmark scripts: statistics, servers, raw connections, load.

The scripts in this folder import it as ``_common`` (they run as
``.venv/bin/python benchmarks/<name>.py`` from the repository root, so this
folder is on ``sys.path``). It owns:

- statistics: percentiles, summaries, the median of per-round ratios;
- the machine description and the output (JSON, Markdown tables, matplotlib
  Agg plots): `parse_args` gives every script ``--out DIR``, by default the
  untracked ``benchmarks/results/local/``; the committed figures that the
  READMEs quote are rewritten only with ``--out benchmarks/results``;
- `RawConnection`: one kept-alive ``http.client`` connection that never
  reconnects silently and knows which worker accepted it (``GET /health``);
- `connections_by_worker`: kept-alive connections grouped by accepting worker;
- `accepting_pid`: which server process holds the server end of a client's TCP
  connection (from ``/proc``), to classify requests of clients we do not own;
- `tree_cpu_seconds`: CPU time of a process and its descendants (``/proc``);
- `worktrees` and `start_revision_server`: earlier commits checked out side by
  side (``git worktree``) and served from their own code, checked per process;
- the load generator: ``python benchmarks/_common.py load ...`` plays counter
  episodes in a separate process and prints one JSON line; `run_load` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import http.client
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gym_sessions.wire import SESSION_COOKIE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts start redis-server and nginx with the test suite's runners
# (tests/services.py), so the repository root must be importable from here.
if REPO not in sys.path:
    sys.path.insert(1, REPO)
PUBLISHED_RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")  # tracked: quoted in READMEs
LOCAL_RESULTS_DIR = os.path.join(PUBLISHED_RESULTS_DIR, "local")  # in .gitignore
results_dir = LOCAL_RESULTS_DIR  # where this run writes; `parse_args` sets it from --out
if REPO not in sys.path:
    sys.path.insert(0, REPO)

COOKIE = SESSION_COOKIE
SESSION_HEADER = "X-Session-Id"

# Statistics -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """``n``, p50, p90, p99, mean, min and max of ``values``."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values) if values else float("nan"),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
    }


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of per-round ratios ``numerators[i] / denominators[i]``."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


# Machine and output ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
        "forward_transports_offered_default_first": forward_transports(),
    }


def event_loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """The loop uvicorn's ``loop="auto"`` picks: uvloop when installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop, "asyncio"
    return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"


def load_note() -> str:
    """One line saying how busy the machine is right now."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cpus"


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse a benchmark's command line, with ``--out DIR`` added; this run then writes there.

    A run writes to the untracked ``benchmarks/results/local/`` unless told
    otherwise, so trying a benchmark never overwrites the committed results.
    """
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=os.path.relpath(LOCAL_RESULTS_DIR),
        help="directory for the JSON and plots (default: %(default)s, untracked; "
        "--out benchmarks/results replaces the committed results)",
    )
    args = parser.parse_args()
    global results_dir
    results_dir = os.path.abspath(args.out)
    return args


def wait_for(url: str, timeout: float = 60.0) -> None:
    """Poll ``url``'s ``GET /health`` until it answers (a server we did not start ourselves)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def write_json(name: str, data: dict[str, Any]) -> str:
    """Write ``<name>.json`` into the results directory (``--out``); returns its path."""
    if isinstance(data.get("machine"), dict):
        data["machine"]["loadavg_at_end"] = os.getloadavg()
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{name}.json")
    with open(path, "w") as file:
        json.dump(data, file, indent=2)
        file.write("\n")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def figure(name: str, draw: Callable[[Any], None], size: tuple[float, float] = (7, 4)) -> str:
    """Draw one matplotlib (Agg) figure with ``draw(axes)`` into ``<results dir>/<name>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=size)
    try:
        draw(axes)
        fig.tight_layout()
        path = os.path.join(results_dir, f"{name}.png")
        os.makedirs(results_dir, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def check_connections(groups: dict[str, list[Any]]) -> None:
    """Raise if a connection of ``groups`` (worker id -> connections) now reaches another worker."""
    for worker, connections in groups.items():
        for connection in connections:
            if connection.get("/health")[1]["worker"] != worker:
                raise RuntimeError("a connection changed worker during the run")


def latency_cdf(
    name: str, per_round: dict[str, list[list[float]]], title: str, legend_size: int = 8
) -> str:
    """A CDF per kind of request of the latencies of every round, into ``<name>.png``."""

    def draw(axes: Any) -> None:
        for kind, batches in per_round.items():
            values = sorted(x for b in batches for x in b)
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.plot(values, fractions, label=kind)
        axes.set_xscale("log")
        axes.set_xlabel("/step latency, ms (log)")
        axes.set_ylabel("fraction of requests")
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=legend_size)

    return figure(name, draw, size=(8, 4.5) if legend_size < 8 else (7, 4))


def needs(program: str, package: str, script: str) -> str:
    """The path of ``program``; exits 2 with one line naming the Debian package if missing."""
    from tests.services import require

    try:
        return require(program, package)
    except FileNotFoundError as exc:
        print(f"{script}: {exc}", file=sys.stderr)
        sys.exit(2)


def bars(
    axes: Any, labels: Sequence[str], values: Sequence[float], ylabel: str, fmt: str = "%.0f"
) -> None:
    """A labelled bar chart on ``axes``."""
    positions = range(len(labels))
    drawn = axes.bar(positions, values, color="#4c72b0")
    axes.set_xticks(list(positions), labels, rotation=15, ha="right", fontsize=8)
    axes.set_ylabel(ylabel)
    axes.bar_label(drawn, fmt=fmt, fontsize=8)


# Servers -----------------------------------------------------------------------------------


def port_of(url: str) -> int:
    """The port of ``http://host:port``."""
    return int(url.rsplit(":", 1)[1].split("/")[0])


def forward_transports() -> list[str | None]:
    """The ``--forward-transport`` choices of ``gym-sessions serve``, default first.

    ``[None]`` when the CLI has no such option (one built-in hop).
    """
    shown = _serve_help()
    found = re.search(r"--forward-transport \{([^}]*)\}", shown)
    if found is None:
        return [None]
    choices = found.group(1).split(",")
    default = re.search(r"\(default (\w+)\)", shown[found.end() :])
    if default and default.group(1) in choices:
        choices.remove(default.group(1))
        choices.insert(0, default.group(1))
    return list(choices)


def transport_args(transport: str | None) -> tuple[str, ...]:
    """``serve`` arguments choosing ``transport`` (none for the built-in hop), handoff off."""
    chosen = () if transport is None else ("--forward-transport", transport)
    return chosen + hop_only_args()


@functools.cache
def hop_only_args() -> tuple[str, ...]:
    """``serve`` arguments that turn connection handoff off, where the CLI has it.

    Scripts that measure the hop itself (a request forwarded on every step of
    a kept-alive connection) need it off: handoff would move the connection
    to the holder after its first forwarded request.
    """
    return ("--handoff", "off") if "--handoff" in _serve_help() else ()


@functools.cache
def _serve_help() -> str:
    """What ``gym-sessions serve --help`` prints (the options this checkout offers)."""
    return subprocess.run(
        [sys.executable, "-m", "gym_sessions", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    ).stdout


def runtime_dir(server: Any) -> str:
    """The runtime directory of a routed `ServerProcess`."""
    dirs = server.runtime_dirs()
    if len(dirs) != 1:
        raise RuntimeError(f"expected one runtime directory, found {dirs}")
    return dirs[0]


def descendants(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as file:
                    todo += [int(child) for child in file.read().split()]
    return found


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by ``pid`` and its live descendants."""
    total = 0
    for process in descendants(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{process}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLOCK_TICKS


def worker_pid(worker_id: str) -> int:
    """The pid in a worker id (``<pid>-<hex>``, see ``gym_sessions.server.app.new_worker_id``)."""
    return int(worker_id.split("-", 1)[0])


def _proc_net_inode(server_port: int, client_port: int) -> str | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as file:
            next(file)
            for line in file:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                if (
                    int(local.rsplit(":", 1)[1], 16) == server_port
                    and int(remote.rsplit(":", 1)[1], 16) == client_port
                    and inode != "0"
                ):
                    return inode
    return None


def accepting_pid(server_pid: int, server_port: int, client_port: int) -> int | None:
    """The server process holding the server end of the client's connection from ``client_port``.

    Reads ``/proc/net/tcp`` for the socket's inode and the descendants' open
    file descriptors for its holder, so it needs no help from the server; the
    connection must be open (a kept-alive one).
    """
    inode = _proc_net_inode(server_port, client_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for process in descendants(server_pid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{process}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{process}/fd/{fd}") == target:
                        return process
    return None


# Revisions side by side (git worktrees) ----------------------------------------------------

PROBE_DIR_ENV = "GYM_BENCH_PROBE_DIR"
_PROBE_PATH = os.path.join(REPO, "benchmarks", "revision_probe")


@dataclasses.dataclass
class Revision:
    """A commit checked out read-only in its own ``git worktree`` under /tmp.

    Attributes:
        label: The name the caller gave (``f720c20``, ``HEAD``).
        commit: The full commit hash.
        path: The worktree.
    """

    label: str
    commit: str
    path: str


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", REPO, *args], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.strip()


def run_in_worktree(path: str, statements: str, timeout: float) -> dict[str, float]:
    """Run ``statements`` in a child Python importing the worktree at ``path`` first.

    The benchmarks directory is importable too (its scripts measure an older
    commit with their own code); the last line the child prints is its JSON result.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys, json; sys.path[:0] = [{path!r}, {here!r}]; {statements}"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def worktrees(labels: Sequence[str]) -> Iterator[list[Revision]]:
    """Check out each commit in ``labels`` in a detached worktree; removed on exit.

    Only ``git worktree add --detach`` and ``git worktree remove --force``: the
    repository's branches, index and working tree are left alone.
    """
    revisions: list[Revision] = []
    try:
        for label in labels:
            commit = _git("rev-parse", "--verify", f"{label}^{{commit}}")
            path = tempfile.mkdtemp(prefix=f"gs-rev-{commit[:7]}-", dir="/tmp")
            os.rmdir(path)  # git creates it
            _git("worktree", "add", "--detach", path, commit)
            revisions.append(Revision(label, commit, path))
        yield revisions
    finally:
        for revision in revisions:
            with contextlib.suppress(subprocess.CalledProcessError):
                _git("worktree", "remove", "--force", revision.path)


def start_revision_server(
    revision: Revision, target: str, *args: str, workers: int, secret: str | None = None
) -> Any:
    """`start_server` importing ``revision``'s code; checks every process imported it.

    The server runs in the worktree (``env -C``: ``python -m`` puts the current
    directory first on ``sys.path``) with the worktree first on ``PYTHONPATH``,
    so neither /work's editable install nor this checkout is imported. The
    probe (``benchmarks/revision_probe/sitecustomize.py``) reports the
    ``gym_sessions.__file__`` of the supervisor and of every worker; any of
    them outside the worktree raises. The evidence is kept in ``.imported``.
    """
    from gym_sessions.server.process import start_server

    probe_dir = tempfile.mkdtemp(prefix="gs-probe-", dir="/tmp")
    env = {"PYTHONPATH": f"{revision.path}:{_PROBE_PATH}", PROBE_DIR_ENV: probe_dir}
    server = start_server(
        target,
        *args,
        workers=workers,
        env=env,
        secret=secret,
        launcher=("env", "-C", revision.path),
    )
    try:
        server.imported = _imported_by(server, probe_dir, workers)
        outside = {
            pid: path
            for pid, path in server.imported.items()
            if not path.startswith(revision.path + os.sep)
        }
        if outside:
            raise RuntimeError(f"{revision.label}: imported outside {revision.path}: {outside}")
    except BaseException:
        server.stop()
        raise
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    return server


def _imported_by(server: Any, probe_dir: str, workers: int, within: float = 30.0) -> dict:
    """``{pid: gym_sessions.__file__}`` of the supervisor and each worker (waits for the probe)."""
    deadline = time.monotonic() + within
    while True:
        pids = [server.process.pid, *server.worker_pids()]
        found = {}
        for pid in pids:
            path = os.path.join(probe_dir, f"{pid}.json")
            with contextlib.suppress(OSError, ValueError), open(path) as file:
                found[pid] = json.load(file)["gym_sessions"]
        # One worker serves in the supervisor's own process (no worker children).
        processes = workers + 1 if workers > 1 else 1
        if len(pids) == processes and len(found) == len(pids):
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"the probe saw {found} of processes {pids}")
        time.sleep(0.1)


# Raw kept-alive connections ----------------------------------------------------------------


class RawConnection:
    """One kept-alive HTTP/1.1 connection (``http.client``, TCP_NODELAY), never reopened silently.

    A reconnect would land on a possibly different worker and spoil the
    local/forwarded classification, so a closed connection raises instead.

    Args:
        url: ``http://host:port`` of the server.
        unix_socket: Connect to this Unix socket instead (a worker's private
            socket, for diagnostics); ``url`` then only names the Host header.
    """

    def __init__(self, url: str, timeout: float = 30.0, unix_socket: str | None = None) -> None:
        host, port = url.split("://", 1)[1].split("/")[0].rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        if unix_socket is None:
            self.connection.connect()
            self.connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local_port: int | None = self.connection.sock.getsockname()[1]
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(unix_socket)
            self.connection.sock = sock
            self.local_port = None
        self.connection.auto_open = 0
        self.worker: str = self.get("/health")[1]["worker"]

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, http.client.HTTPResponse]:
        """Send a JSON request; returns status, parsed JSON reply and the response."""
        payload = b"" if body is None else json.dumps(body).encode()
        send = {"Content-Type": "application/json", **(headers or {})}
        self.connection.request(method, path, body=payload, headers=send)
        response = self.connection.getresponse()
        data = response.read()
        if response.will_close:
            raise RuntimeError("the server closed a kept-alive connection")
        return response.status, json.loads(data) if data else None, response

    def get(self, path: str) -> tuple[int, Any]:
        status, data, _ = self.request("GET", path)
        return status, data

    def close(self) -> None:
        self.connection.close()


def session_cookie(response: http.client.HTTPResponse) -> str | None:
    """The session cookie a reply sets, or ``None``."""
    for name, value in response.getheaders():
        if name.lower() == "set-cookie":
            key, _, rest = value.partition("=")
            if key.strip() == COOKIE:
                return rest.split(";", 1)[0]
    return None


def connections_by_worker(
    url: str, workers: int, per_worker: int, max_connections: int = 400
) -> dict[str, list[RawConnection]]:
    """Open kept-alive connections until each of ``workers`` workers accepted ``per_worker``.

    Extra connections are closed. Raises if the kernel keeps handing new
    connections to the same few workers for ``max_connections`` tries.
    """
    groups: dict[str, list[RawConnection]] = {}
    opened = 0
    try:
        while len(groups) < workers or any(len(c) < per_worker for c in groups.values()):
            if opened >= max_connections:
                raise RuntimeError(
                    f"after {opened} connections: { ({w: len(c) for w, c in groups.items()}) }"
                )
            connection = RawConnection(url)
            opened += 1
            group = groups.setdefault(connection.worker, [])
            if len(group) < per_worker:
                group.append(connection)
            else:
                connection.close()
    except BaseException:
        for group in groups.values():
            for connection in group:
                connection.close()
        raise
    return groups


# Load generator (runs in its own process) --------------------------------------------------


class _HeaderedClient:
    """Adds fixed headers to every ``post`` of an aiohttp client (duck-types what `play` uses)."""

    def __init__(self, client: Any, headers: dict[str, str]) -> None:
        self.client = client
        self.headers = headers

    def post(self, url: str, *, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        return self.client.post(url, headers={**self.headers, **(headers or {})}, **kwargs)


async def _play_load(
    url: str, episodes: list[Any], concurrency: int, limit: int, fresh: bool, header: bool
) -> list[Any]:
    from envs.counter_load import client_session, play

    gate = asyncio.Semaphore(concurrency)
    async with client_session(fresh_connections=fresh, limit=limit) as client:

        async def one(episode: Any) -> Any:
            async with gate:
                target = (
                    _HeaderedClient(client, {SESSION_HEADER: episode.session_id})
                    if header
                    else client
                )
                try:
                    return await play(target, url, episode)
                except Exception as exc:  # one broken episode must not end the run
                    episode.error_codes.append(type(exc).__name__)
                    return episode

        return await asyncio.gather(*[one(e) for e in episodes])


def _load_main(argv: Sequence[str]) -> None:
    from envs.counter_load import make_episodes

    parser = argparse.ArgumentParser(prog="_common.py load")
    parser.add_argument("--url", required=True)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--session-header", action="store_true")
    args = parser.parse_args(argv)

    def run(episodes: list[Any]) -> list[Any]:
        return asyncio.run(
            _play_load(
                args.url, episodes, args.concurrency, args.limit, args.fresh, args.session_header
            )
        )

    if args.warmup:
        run(make_episodes(args.warmup, seed=args.seed * 2 + 1))
    episodes = make_episodes(args.episodes, seed=args.seed * 2)
    cpu_before = time.process_time()
    started = time.perf_counter()
    done = run(episodes)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    errors: dict[str, int] = {}
    for episode in done:
        for code in episode.error_codes:
            errors[code] = errors.get(code, 0) + 1
    print(
        json.dumps(
            {
                "episodes": len(done),
                "correct": sum(e.reward == 1.0 for e in done),
                "requests": sum(len(e.statuses) for e in done),
                "seconds": seconds,
                "episodes_per_second": len(done) / seconds,
                "client_cpu_seconds": cpu,
                "client_max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "errors": errors,
            }
        )
    )


def run_load(
    url: str,
    *,
    episodes: int,
    seed: int,
    fresh: bool = False,
    limit: int = 32,
    concurrency: int = 64,
    warmup: int = 100,
    session_header: bool = False,
    measure_pids: Sequence[int] = (),
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Play counter episodes at ``url`` from a separate process; returns its JSON report.

    ``measure_pids``: server processes (with descendants) whose CPU time over
    the whole run (warm-up included) goes into ``server_cpu_seconds``.
    """
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "load",
        f"--url={url}",
        f"--episodes={episodes}",
        f"--warmup={warmup}",
        f"--seed={seed}",
        f"--concurrency={concurrency}",
        f"--limit={limit}",
    ]
    command += ["--fresh"] if fresh else []
    command += ["--session-header"] if session_header else []
    cpu_before = sum(tree_cpu_seconds(pid) for pid in measure_pids)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )
    cpu_after = sum(tree_cpu_seconds(pid) for pid in measure_pids)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["server_cpu_seconds_incl_warmup"] = cpu_after - cpu_before
    report["warmup_episodes"] = warmup
    return report


if __name__ == "__main__":
    if sys.argv[1:2] != ["load"]:
        sys.exit("usage: python benchmarks/_common.py load --url URL [options]")
    _load_main(sys.argv[2:])


def worker_healths(url: str, workers: int) -> dict[str, dict[str, Any]]:
    """Each worker's ``/health`` (new connections until ``workers`` answered)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(400):
        connection = RawConnection(url)
        _, health = connection.get("/health")
        connection.close()
        seen[health["worker"]] = health
        if len(seen) == workers:
            break
    return seen


def worker_deliveries(url: str, workers: int) -> dict[str, dict[str, Any]]:
    """Each worker's ``/health`` delivery counts."""
    return {w: h.get("deliveries", {}) for w, h in worker_healths(url, workers).items()}
