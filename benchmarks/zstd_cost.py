"""zstd for binary replies (`gym_sessions.compression`): what it costs and saves per frame.

**Per frame** (in process): the observations of three envs, taken after 60
random steps, compressed at `compression.LEVEL` and decompressed as a client
does: raw ALE Pong frames (210x160x3, `tests.e2e.pixel_envs.pong`, the
``atari`` extra), preprocessed ones (``envs.atari:pong``: 4x84x84), and noise
frames (`PixelEnv`), which zstd cannot shrink (the server then sends them as
they are). Medians over rounds of per-call means.

**Over loopback** (a real 1-worker server of preprocessed Pong): one
`RemoteEnv` asking for zstd (``Accept-Encoding: zstd``, what a client asks
beyond loopback) and one asking for none, stepped in interleaved rounds;
medians over rounds of per-round p50s. Loopback moves 100 KB in tens of
microseconds, so this is what compression costs where it saves nothing.

**On a link of bandwidth B**: these machines have no second host, so the
step time on a slower link is modelled, not measured: the loopback p50 plus
the reply's bytes over B (each way's request bytes are the same with or
without compression and are left out).

    .venv/bin/python benchmarks/zstd_cost.py [--rounds 20] [--batch 100]

Prints Markdown tables and writes compression.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import _common
import numpy as np
from routing_cost import interleaved_rounds

from envs.atari import pong as preprocessed_pong
from gym_sessions import compression
from gym_sessions.client.remote_env import RemoteEnv
from gym_sessions.server.process import start_server
from tests.e2e.pixel_envs import PixelEnv
from tests.e2e.pixel_envs import pong as raw_pong

LINKS = {"100 Mbit/s": 100e6 / 8, "1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8}


def _frame_after(env: Any, steps: int = 60) -> bytes:
    observation, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        observation, *_ = env.step(int(rng.integers(env.action_space.n)))
    env.close()
    return np.ascontiguousarray(observation).tobytes()


def per_frame(rounds: int) -> list[dict[str, Any]]:
    frames = {
        "Pong, raw (210x160x3)": _frame_after(raw_pong()),
        "Pong, preprocessed (4x84x84)": _frame_after(preprocessed_pong()),
        "noise (210x160x3)": _frame_after(PixelEnv()),
    }
    rows = []
    for name, data in frames.items():
        packed = compression.compress(data)
        compress_us, decompress_us = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(50):
                compression.compress(data)
            compress_us.append((time.perf_counter() - start) / 50 * 1e6)
            start = time.perf_counter()
            for _ in range(50):
                compression.decompress(packed, len(data))
            decompress_us.append((time.perf_counter() - start) / 50 * 1e6)
        rows.append(
            {
                "frame": name,
                "bytes": len(data),
                "compressed_bytes": len(packed),
                "compress_us": statistics.median(compress_us),
                "decompress_us": statistics.median(decompress_us),
            }
        )
    return rows


def over_loopback(rounds: int, batch: int) -> dict[str, Any]:
    server = start_server(
        "envs.atari:pong", workers=1, tmpdir=tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    )
    envs = {
        "zstd": RemoteEnv(server.url, headers={"Accept-Encoding": "zstd"}),
        "identity": RemoteEnv(server.url, headers={"Accept-Encoding": "identity"}),
    }
    rng = np.random.default_rng(1)
    try:
        for env in envs.values():
            env.reset(seed=0)

        def stepper(env: RemoteEnv):
            def batch_of(r: int, n: int, into: list[float]) -> None:
                for _ in range(n):
                    action = int(rng.integers(6))
                    start = time.perf_counter()
                    _, _, terminated, truncated, _ = env.step(action)
                    into.append(time.perf_counter() - start)
                    if terminated or truncated:
                        env.reset()

            return batch_of

        per_round = interleaved_rounds(
            {kind: stepper(env) for kind, env in envs.items()},
            cycle=1,
            warmup=50,
            rounds=rounds,
            batch=batch,
        )
    finally:
        for env in envs.values():
            env.close()
        server.stop()
    p50 = {
        kind: statistics.median(_common.percentile(samples, 50) for samples in rounds_)
        for kind, rounds_ in per_round.items()
    }
    ratio = _common.median_ratio(
        [_common.percentile(s, 50) for s in per_round["zstd"]],
        [_common.percentile(s, 50) for s in per_round["identity"]],
    )
    return {"p50_s": p50, "zstd_over_identity": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=100)
    args = _common.parse_args(parser)
    print(_common.load_note())
    frames = per_frame(args.rounds)
    print(
        _common.markdown_table(
            ["frame", "bytes", "zstd bytes", "compress", "decompress"],
            [
                [
                    f["frame"],
                    f"{f['bytes']:,}",
                    f"{f['compressed_bytes']:,}",
                    f"{f['compress_us']:.0f} µs",
                    f"{f['decompress_us']:.0f} µs",
                ]
                for f in frames
            ],
        )
    )
    loop = over_loopback(args.rounds, args.batch)
    print()
    print(
        f"loopback, preprocessed Pong at 1 worker: step p50 zstd "
        f"{loop['p50_s']['zstd'] * 1e3:.3f} ms, none {loop['p50_s']['identity'] * 1e3:.3f} ms "
        f"(zstd/none {loop['zstd_over_identity']:.2f})"
    )
    preprocessed = frames[1]
    reply = {"zstd": preprocessed["compressed_bytes"], "identity": preprocessed["bytes"]}
    modelled = {
        link: {kind: loop["p50_s"][kind] + reply[kind] / rate for kind in reply}
        for link, rate in LINKS.items()
    }
    print()
    print(
        _common.markdown_table(
            ["link (modelled)", "step, zstd", "step, none", "none / zstd"],
            [
                [
                    link,
                    f"{m['zstd'] * 1e3:.2f} ms",
                    f"{m['identity'] * 1e3:.2f} ms",
                    f"{m['identity'] / m['zstd']:.1f}",
                ]
                for link, m in modelled.items()
            ],
        )
    )
    path = _common.write_json(
        "compression",
        {
            "machine": _common.machine(),
            "frames": frames,
            "loopback": loop,
            "modelled_links": modelled,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
