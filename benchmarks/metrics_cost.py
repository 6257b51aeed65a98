"""What recording the operator metrics costs a ``/step``: metrics on vs ``--metrics off``.

Two 4-worker counter servers side by side, one with metrics (the default) and
one with ``--metrics off`` (no middleware, no recording at all). On each, one
session per worker and sequential steps over ONE kept-alive connection at a
time (``http.client``, TCP_NODELAY), served locally (the connection's worker
holds the session) or forwarded (another worker accepted the connection), as
in ``routing_cost.py``. The four classes run in interleaved rounds (a batch of
each per round, the order rotating) and each ratio is the median of per-round
p50 ratios, since the machine is shared and noisy. Beside it, in process and
in multiprocess mode (no network, so far less noise): one request's recording
(`WorkerMetrics.request_done` plus a tool call's histogram observation), and a
whole ``/step`` through a `WorkerApp` driven with ASGI messages, metrics on and
off (best of 7 interleaved batches of 2,000).

    .venv/bin/python benchmarks/metrics_cost.py [--rounds 30] [--batch 100]

Prints a Markdown table; writes metrics_cost.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import textwrap

import _common
from routing_cost import Fleet, interleaved_rounds

from gym_sessions.server.process import start_server

TARGET = "envs.counter:CounterEnv"
WORKERS = 4
MODES = {"metrics on": (), "metrics off": ("--metrics", "off")}

# Run in a fresh interpreter: multiprocess mode is chosen when prometheus_client
# is first imported, from the environment.
_IN_PROCESS = textwrap.dedent(
    """
    import asyncio, json, os, tempfile, time, timeit
    runtime_dir = tempfile.mkdtemp()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(runtime_dir, "metrics")
    os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    from envs.counter import CounterEnv
    from gym_sessions.metrics import WorkerMetrics, MetricsDirectory
    from gym_sessions.scope_keys import Served
    from gym_sessions.server.app import WorkerApp
    from gym_sessions.server.env_server import GymEnvServer
    from gym_sessions.settings import Settings

    directory = MetricsDirectory(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    metrics = WorkerMetrics("w", ["/step"], directory)
    assert metrics.multiprocess
    def one():
        metrics.tool_call("step", "http", 0.0002)
        metrics.request_done("/step", 200, Served.LOCAL)
    n = 100_000
    recording = min(timeit.repeat(one, number=n, repeat=5)) / n * 1e6

    async def call(app, path, body, headers):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 8000),
                 "headers": [(b"content-length", str(len(body)).encode()), *headers]}
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        async def receive():
            return pending.pop() if pending else {"type": "http.disconnect"}
        messages = []
        async def send(message):
            messages.append(message)
        await app(scope, receive, send)
        return messages

    async def per_step(app, cookie, n):
        started = time.perf_counter()
        for _ in range(n):
            await call(app, "/step", b'{"action": 1}', [cookie])
        return (time.perf_counter() - started) / n * 1e6

    async def main():
        apps = {}
        for on in (True, False):
            settings = Settings(secret="x" * 40, metrics=on, runtime_dir=runtime_dir)
            app = WorkerApp(GymEnvServer(CounterEnv), settings)
            start = await call(app, "/reset", b"{}", [])
            cookie = dict(start[0]["headers"])[b"set-cookie"].split(b";")[0]
            apps[on] = (app, (b"cookie", cookie))
            await per_step(app, apps[on][1], 500)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(7):  # interleaved: the best of each
            for on, (app, cookie) in apps.items():
                best[on] = min(best[on], await per_step(app, cookie, 2000))
        return best

    best = asyncio.run(main())
    print(json.dumps({"recording_us": recording, "asgi_on_us": best[True],
                      "asgi_off_us": best[False]}))
    """
)


def in_process() -> dict[str, float]:
    """In-process costs, in microseconds: recording one step; a whole ASGI step on and off."""
    out = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=200, help="unrecorded steps per class")
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    with contextlib.ExitStack() as stack:
        fleets = {}
        for mode, flags in MODES.items():
            server = stack.enter_context(
                start_server(TARGET, *flags, *_common.hop_only_args(), workers=WORKERS)
            )
            fleets[mode] = Fleet(server)
            stack.callback(fleets[mode].close)
        batches = {}
        for mode, fleet in fleets.items():
            batches[f"{mode}, local"] = fleet.local
            batches[f"{mode}, forwarded"] = fleet.forwarded
        classes = list(batches)
        per_round = interleaved_rounds(
            batches, cycle=WORKERS, warmup=args.warmup, rounds=args.rounds, batch=args.batch
        )
        for fleet in fleets.values():
            fleet.check()
    p50s = {k: [_common.percentile(b, 50) for b in per_round[k]] for k in classes}
    pooled = {k: _common.summary([x for b in per_round[k] for x in b]) for k in classes}
    ratios = {
        hop: _common.median_ratio(p50s[f"metrics on, {hop}"], p50s[f"metrics off, {hop}"])
        for hop in ("local", "forwarded")
    }
    inside = in_process()
    rows = [
        [kind, f"{pooled[kind]['p50']:.3f}", f"{pooled[kind]['p99']:.3f}", pooled[kind]["n"]]
        for kind in classes
    ]
    print(_common.markdown_table(["class", "p50 ms", "p99 ms", "steps"], rows))
    for hop, ratio in ratios.items():
        print(f"{hop}: metrics on / off, median of per-round p50 ratios: {ratio:.3f}")
    print(
        f"in process: recording one /step {inside['recording_us']:.2f} us; a whole /step "
        f"through the app {inside['asgi_on_us']:.1f} us on, {inside['asgi_off_us']:.1f} us off"
    )
    report = {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "pooled_ms": pooled,
        "on_over_off_p50": ratios,
        "in_process_us": inside,
        "cwd": os.getcwd(),
    }
    print(f"wrote {_common.write_json('metrics_cost', report)}")


if __name__ == "__main__":
    main()
