"""Pixel observations over the wire: binary values (docs/design.md §3.15) against JSON and local.

**Over HTTP** (default): a real ``gym-sessions serve`` process at 1 worker per
env, each class stepped by its own `RemoteEnv` (its own session) over one
kept-alive connection, sequential steps with random actions, episodes that
end reset outside the timed calls; the server CPU of a class is the server's
during that class's batches (one batch runs at a time):

- ``pong``: ALE ``Pong-v5`` (`tests.e2e.pixel_envs.pong`, the ``atari``
  extra; 210x160x3 uint8 frames); ``pixels``: `PixelEnv`, a synthetic env of
  the same spaces whose own step costs next to nothing (what a frame's
  transfer costs alone); ``cartpole``: CartPole-v1;
- each remote in the binary encoding (what the clients use, as the server
  offers it) and in JSON (the same client with the offer ignored, i.e. what
  every client sent before), and each env stepped locally, in this process.

Rounds interleave the classes (order rotated each round); each class's
figure is the median over rounds of its per-round p50, and each ratio the
median over rounds of the per-round ratio of p50s. JSON Pong steps cost tens
of ms, so that class times fewer steps per round.

**Formats** (``--formats``, also part of the default run): one reply carrying
an observation (a Pong frame; a CartPole observation) encoded as a server
encodes it and decoded as a client does, in process, against alternatives: a
msgpack map with the array as an extension type (dtype, shape, raw bytes;
``msgpack``, in the ``dev`` extra), ``np.save`` bytes of the array beside a
JSON head, and JSON. Medians over interleaved rounds of per-call means.

    .venv/bin/python benchmarks/binary_values.py [--rounds 30] [--batch 100] [--no-pong]
    .venv/bin/python benchmarks/binary_values.py --formats

Prints Markdown tables and writes binary_values.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import _common
import gymnasium as gym
import numpy as np
from routing_cost import interleaved_rounds

from gym_sessions.client.exchange import Reply
from gym_sessions.client.protocol import reply_fields
from gym_sessions.client.remote_env import RemoteEnv
from gym_sessions.server.process import start_server
from gym_sessions.spaces import value_from_json, value_to_json
from gym_sessions.spaces.binary import value_from_tree
from gym_sessions.value_messages import BINARY_MEDIA_TYPE, VALUE_REPLY, SpaceValue, encode_message
from tests.e2e.pixel_envs import PixelEnv

TARGETS = {
    "pong": "tests.e2e.pixel_envs:pong",
    "pixels": "tests.e2e.pixel_envs:PixelEnv",
    "cartpole": "CartPole-v1",
}
#: JSON Pong steps are ~50 ms: this share of ``--batch`` per round keeps a round short.
SLOW_SHARE = 0.1


def local_env(name: str) -> gym.Env:
    if name == "pong":
        from tests.e2e.pixel_envs import pong

        return pong()
    if name == "pixels":
        return PixelEnv()
    return gym.make("CartPole-v1")


def as_json_client(env: RemoteEnv) -> RemoteEnv:
    """``env`` speaking JSON, as against a server that offers no binary (an older client)."""
    protocol = env._protocol
    protocol.description = dataclasses.replace(protocol.description, binary_values=False)
    return env


class Stepper:
    """One class: an env (remote or local) stepped with seeded random actions.

    With ``server_pid``, also the CPU its steps cost (warm-up included): this
    thread's and the server process tree's (``/proc``, 10 ms ticks: summed
    over all rounds).
    """

    def __init__(self, env: Any, seed: int, server_pid: int | None = None) -> None:
        self.env = env
        self.rng = np.random.default_rng(seed)
        self.env.reset(seed=seed)
        self.n = int(env.action_space.n)
        self.server_pid = server_pid
        self.steps = 0
        self.client_cpu = self.server_cpu = 0.0

    def batch(self, calls: int, into: list[float]) -> None:
        client, server = time.thread_time(), self._server_cpu()
        for _ in range(calls):
            action = int(self.rng.integers(self.n))
            started = time.perf_counter()
            _, _, terminated, truncated, _ = self.env.step(action)
            into.append(time.perf_counter() - started)
            if terminated or truncated:
                self.env.reset()
        self.steps += calls
        self.client_cpu += time.thread_time() - client
        self.server_cpu += self._server_cpu() - server

    def _server_cpu(self) -> float:
        return 0.0 if self.server_pid is None else _common.tree_cpu_seconds(self.server_pid)


def http_run(args: argparse.Namespace) -> dict[str, Any]:
    names = [name for name in TARGETS if name != "pong" or not args.no_pong]
    # One server per env, both encodings on it (an encoding is per request): servers of
    # their own measured a steady difference of their processes, not of the encodings.
    # Classes run one batch at a time, so a batch's server CPU is its class's.
    servers = {name: start_server(TARGETS[name], workers=1) for name in names}
    try:
        steppers: dict[str, Stepper] = {}
        for i, name in enumerate(names):
            server = servers[name]
            for encoding, seed in (("binary", 10), ("JSON", 20)):
                env = RemoteEnv(server.url)
                if encoding == "JSON":
                    as_json_client(env)
                steppers[f"{name} {encoding}"] = Stepper(env, seed + i, server.process.pid)
            steppers[f"{name} local"] = Stepper(local_env(name), 30 + i)
        for key, stepper in steppers.items():
            if key.endswith("binary"):
                assert stepper.env._protocol.description.binary_values, key

        def batch_of(key: str) -> Callable[[int, int, list[float]], None]:
            stepper = steppers[key]
            slow = key.startswith(("pong JSON", "pixels JSON"))

            def run(r: int, calls: int, into: list[float]) -> None:
                calls = max(3, int(calls * SLOW_SHARE)) if slow else calls
                stepper.batch(calls, into)

            return run

        per_round = interleaved_rounds(
            {key: batch_of(key) for key in steppers},
            cycle=1,
            warmup=args.batch,
            rounds=args.rounds,
            batch=args.batch,
        )
    finally:
        for server in servers.values():
            server.stop()
    p50s = {key: [_common.percentile(r, 50) for r in rounds] for key, rounds in per_round.items()}
    cpu = {
        key: {
            "client_us": stepper.client_cpu / stepper.steps * 1e6,
            "server_us": stepper.server_cpu / stepper.steps * 1e6,
        }
        for key, stepper in steppers.items()
        if stepper.server_pid is not None and stepper.steps
    }
    return {
        "cpu_per_step": cpu,
        "p50_ms": {key: statistics.median(v) * 1e3 for key, v in p50s.items()},
        "p99_ms": {
            key: statistics.median(_common.percentile(r, 99) for r in rounds) * 1e3
            for key, rounds in per_round.items()
        },
        "per_round_p50_s": p50s,
    }


def ratios(p50s: dict[str, list[float]]) -> list[tuple[str, float]]:
    pairs = [
        (
            "remote Pong step / remote CartPole step, binary (1 worker)",
            "pong binary",
            "cartpole binary",
        ),
        ("remote Pong step / local Pong step, binary", "pong binary", "pong local"),
        ("remote Pong step / remote CartPole step, JSON (before)", "pong JSON", "cartpole JSON"),
        ("remote Pong step / local Pong step, JSON (before)", "pong JSON", "pong local"),
        ("remote CartPole step, binary / JSON", "cartpole binary", "cartpole JSON"),
        (
            "remote synthetic frame step / remote CartPole step, binary",
            "pixels binary",
            "cartpole binary",
        ),
        ("remote synthetic frame step, binary / JSON", "pixels binary", "pixels JSON"),
        ("remote Pong step, binary / JSON", "pong binary", "pong JSON"),
    ]
    return [
        (label, _common.median_ratio(p50s[a], p50s[b]))
        for label, a, b in pairs
        if a in p50s and b in p50s
    ]


# Formats ------------------------------------------------------------------------------------

_ARRAY_EXT = 1


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:
        return None
    return msgpack


def msgpack_codec(space: Any) -> tuple[Callable[[dict], bytes], Callable[[bytes], dict]] | None:
    """A msgpack map with each array an ext type: dtype str, shape, raw bytes (read as a view)."""
    msgpack = _msgpack()
    if msgpack is None:
        return None

    def default(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            head = json.dumps([value.dtype.str, value.shape]).encode()
            return msgpack.ExtType(
                _ARRAY_EXT, struct.pack("<I", len(head)) + head + value.tobytes()
            )
        raise TypeError(type(value))

    def ext_hook(code: int, data: bytes) -> Any:
        (size,) = struct.unpack_from("<I", data)
        dtype, shape = json.loads(data[4 : 4 + size])
        return np.frombuffer(data, dtype, offset=4 + size).reshape(shape)

    def encode(reply: dict) -> bytes:
        return msgpack.packb(reply, default=default)

    def decode(body: bytes) -> dict:
        return msgpack.unpackb(body, ext_hook=ext_hook)

    return encode, decode


def npy_codec(space: Any) -> tuple[Callable[[dict], bytes], Callable[[bytes], dict]]:
    """``np.save`` bytes of the observation after a length-prefixed JSON head of the rest."""

    def encode(reply: dict) -> bytes:
        head = json.dumps({k: v for k, v in reply.items() if k != "observation"}).encode()
        out = io.BytesIO()
        out.write(struct.pack("<I", len(head)) + head)
        np.save(out, reply["observation"], allow_pickle=False)
        return out.getvalue()

    def decode(body: bytes) -> dict:
        (size,) = struct.unpack_from("<I", body)
        fields = json.loads(body[4 : 4 + size])
        fields["observation"] = np.load(io.BytesIO(body[4 + size :]), allow_pickle=False)
        return fields

    return encode, decode


def ours_codec(space: Any) -> tuple[Callable[[dict], bytes], Callable[[bytes], dict]]:
    """This project's binary message: what `GymEnvServer` sends and `RemoteEnvProtocol` reads."""

    def encode(reply: dict) -> bytes:
        return encode_message(
            {**reply, "observation": SpaceValue(space, reply["observation"])}, VALUE_REPLY
        )

    def decode(body: bytes) -> dict:
        fields = reply_fields(Reply(200, {"content-type": BINARY_MEDIA_TYPE}, body))
        value = fields["observation"]
        fields["observation"] = value_from_tree(space, value.tree, value.buffers)
        return fields

    return encode, decode


def json_codec(space: Any) -> tuple[Callable[[dict], bytes], Callable[[bytes], dict]]:
    """The JSON reply (`value_to_json`, the reply encoder; ``json.loads``, `value_from_json`)."""
    encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def encode(reply: dict) -> bytes:
        return encoder.encode(
            {**reply, "observation": value_to_json(space, reply["observation"])}
        ).encode()

    def decode(body: bytes) -> dict:
        fields = json.loads(body)
        fields["observation"] = value_from_json(space, fields["observation"])
        return fields

    return encode, decode


def formats_run(args: argparse.Namespace) -> dict[str, Any]:
    frames = local_env("pixels" if args.no_pong else "pong")
    envs = {"Pong frame (210x160x3 uint8)": frames, "CartPole observation": gym.make("CartPole-v1")}
    codecs = {
        "binary (ours)": ours_codec,
        "msgpack + ndarray ext": msgpack_codec,
        "np.save + JSON head": npy_codec,
        "JSON": json_codec,
    }
    out: dict[str, Any] = {}
    for label, env in envs.items():
        space = env.observation_space
        observation, _ = env.reset(seed=0)
        reply = {
            "observation": observation,
            "reward": 1.0,
            "terminated": False,
            "truncated": False,
            "info": {},
        }
        made = {name: make(space) for name, make in codecs.items()}
        made = {name: codec for name, codec in made.items() if codec is not None}
        calls = 20 if observation.size > 1000 else 2000
        rows: dict[str, dict[str, list[float]]] = {
            name: {"encode": [], "decode": []} for name in made
        }
        sizes = {}
        for name, (encode, decode) in made.items():
            body = encode(reply)
            sizes[name] = len(body)
            back = decode(body)["observation"]
            assert np.array_equal(back, observation) and back.dtype == observation.dtype, name
        for r in range(args.format_rounds):
            order = list(made)
            order = order[r % len(order) :] + order[: r % len(order)]
            for name in order:
                encode, decode = made[name]
                started = time.perf_counter()
                for _ in range(calls):
                    body = encode(reply)
                rows[name]["encode"].append((time.perf_counter() - started) / calls)
                started = time.perf_counter()
                for _ in range(calls):
                    decode(body)
                rows[name]["decode"].append((time.perf_counter() - started) / calls)
        out[label] = {
            name: {
                "bytes": sizes[name],
                "encode_us": statistics.median(rows[name]["encode"]) * 1e6,
                "decode_us": statistics.median(rows[name]["decode"]) * 1e6,
            }
            for name in made
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--format-rounds", type=int, default=15)
    parser.add_argument(
        "--no-pong", action="store_true", help="without ale-py: the synthetic env only"
    )
    parser.add_argument("--formats", action="store_true", help="the format comparison only")
    args = _common.parse_args(parser)
    results: dict[str, Any] = {"machine": _common.machine(), "args": vars(args)}
    print(_common.load_note())
    if not args.formats:
        results["http"] = http_run(args)
        p50 = results["http"]["p50_ms"]
        p99 = results["http"]["p99_ms"]
        cpu = results["http"]["cpu_per_step"]
        print(
            _common.markdown_table(
                ["class", "p50 ms", "p99 ms", "client CPU us/step", "server CPU us/step"],
                [
                    (
                        k,
                        f"{p50[k]:.3f}",
                        f"{p99[k]:.3f}",
                        f"{cpu[k]['client_us']:.0f}" if k in cpu else "",
                        f"{cpu[k]['server_us']:.0f}" if k in cpu else "",
                    )
                    for k in p50
                ],
            )
        )
        found = ratios(results["http"]["per_round_p50_s"])
        results["ratios"] = dict(found)
        print()
        print(
            _common.markdown_table(
                ["ratio (median of per-round p50 ratios)", "value"],
                [(k, f"{v:.2f}") for k, v in found],
            )
        )
    results["formats"] = formats_run(args)
    for label, rows in results["formats"].items():
        print()
        print(f"{label}: one step reply, server encode + client decode")
        print(
            _common.markdown_table(
                ["format", "bytes", "encode us", "decode us", "total us"],
                [
                    (
                        name,
                        row["bytes"],
                        f"{row['encode_us']:.1f}",
                        f"{row['decode_us']:.1f}",
                        f"{row['encode_us'] + row['decode_us']:.1f}",
                    )
                    for name, row in rows.items()
                ],
            )
        )
    print()
    print(_common.load_note())
    print(_common.write_json("binary_values", results))


if __name__ == "__main__":
    main()
