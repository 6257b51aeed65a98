"""The cross-host hop: one tool call (counter ``/step``) local, forwarded on one host, to another.

Sequential steps over ONE kept-alive connection at a time (``http.client``,
TCP_NODELAY; `_common.RawConnection`), against servers running side by side on
loopback:

- a plain 2-worker server (file claims, private Unix sockets);
- two "hosts" sharing one ``redis-server`` (``tests.services.run_redis``):
  each ``gym-sessions serve envs.counter:CounterEnv --workers 2 --claims
  redis://...`` with the same ``GYM_SESSIONS_SECRET``, so their 4 workers
  find each other's claims and private TCP listeners in Redis and sign what
  they forward.

Every server runs with ``--debug-worker-header``. As in ``routing_cost.py``,
the script opens kept-alive connections until every worker accepted two
(``GET /health`` names the accepting worker), starts one session per worker on
that worker's first connection, and steps each session over a chosen
connection. Every reply is classified by its debug headers: ``x-gym-worker``
names the worker that served it, ``x-gym-forwarded-by`` the worker that
forwarded it (absent when served where it arrived). The classes:

- **local, file claims**: a step over the claimant's second connection;
- **forwarded on one host, file claims**: over the other worker's connection
  (claim file read, hop over the claimant's private Unix socket);
- **local, Redis claims**: over the claimant's second connection, either host;
- **forwarded on one host, Redis claims**: over the other worker of the same
  host (claim read from Redis, hop over TCP with a signature; a diagnostic);
- **forwarded to the other host, Redis claims**: over a connection of the other
  host (the same mechanism; on one machine "another host" is another port on
  127.0.0.1, so a real network's round trip comes on top).

In process, the script also times `ForwardSigner` signing and verifying a
``/step`` with a session cookie (the hop's only cryptographic work).

A request served otherwise than its class says (wrong worker, or forwarded when
it should not be) stops the run, as does a wrong count. The classes run in
interleaved rounds (a batch of each per round, the order rotating, the
claimant and the forwarding worker rotating); ratios are the median of
per-round ratios, since the machine is shared and noisy.

    .venv/bin/python benchmarks/cross_host.py [--rounds 40] [--batch 100]

Needs ``redis-server`` (``apt-get install -y redis-server``); exits 2 without it.
Prints Markdown tables; writes cross_host.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import redis
from _common import RawConnection, connections_by_worker, markdown_table
from routing_cost import SteppedSession, interleaved_rounds

from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.server.process import ServerProcess, start_server
from tests.services import registered_workers, run_redis, wait_for_registrations

TARGET = "envs.counter:CounterEnv"
WORKERS_PER_SERVER = 2
HOSTS = 2

LOCAL_FILE = "local, file claims"
FORWARDED_FILE = "forwarded on one host, file claims (Unix socket)"
LOCAL_REDIS = "local, Redis claims"
FORWARDED_REDIS_SAME = "forwarded on one host, Redis claims (TCP + signature)"
FORWARDED_REDIS_OTHER = "forwarded to the other host, Redis claims (TCP + signature)"
CLASSES = (LOCAL_FILE, FORWARDED_FILE, LOCAL_REDIS, FORWARDED_REDIS_SAME, FORWARDED_REDIS_OTHER)
# Each class's local reference: the same configuration, served where it arrives.
BASELINE = {
    FORWARDED_FILE: LOCAL_FILE,
    FORWARDED_REDIS_SAME: LOCAL_REDIS,
    FORWARDED_REDIS_OTHER: LOCAL_REDIS,
}


class CheckedSession(SteppedSession):
    """A counter session whose every step is checked: count, and who served and forwarded it."""

    def __init__(self, start_on: RawConnection) -> None:
        super().__init__(start_on)
        probe: list[float] = []
        self.checked_steps(start_on, 2, probe, via=None)  # the claim is where it started

    def checked_steps(
        self, connection: RawConnection, n: int, into: list[float], via: str | None
    ) -> None:
        """``n`` sequential steps over ``connection``; appends each latency (ms) to ``into``.

        ``via``: the worker expected to forward every step (``None``: served
        by the claimant where it arrived).
        """
        for i in range(n):
            action = 1 if i % 2 == 0 else -1
            started = time.perf_counter_ns()
            status, reply, response = connection.request(
                "POST", "/step", {"action": action}, self.headers
            )
            into.append((time.perf_counter_ns() - started) / 1e6)
            self.count += action
            if status != 200 or reply["observation"] != self.count:
                raise RuntimeError(f"step went wrong: {status} {reply}, expected {self.count}")
            served_by = response.getheader("x-gym-worker")
            forwarded_by = response.getheader("x-gym-forwarded-by")
            if served_by != self.owner or forwarded_by != via:
                raise RuntimeError(
                    f"expected served by {self.owner} forwarded by {via}; "
                    f"got served by {served_by} forwarded by {forwarded_by}"
                )


class Host:
    """Connections to one server grouped by accepting worker, one session per worker."""

    def __init__(self, name: str, server: ServerProcess) -> None:
        self.name = name
        self.server = server
        self.groups = connections_by_worker(server.url, workers=WORKERS_PER_SERVER, per_worker=2)
        self.workers = sorted(self.groups)
        self.sessions = {w: CheckedSession(self.groups[w][0]) for w in self.workers}

    def local(self, worker: str, n: int, into: list[float]) -> None:
        self.sessions[worker].checked_steps(self.groups[worker][1], n, into, via=None)

    def connection_of(self, worker: str) -> RawConnection:
        """The first connection ``worker`` accepted (forwarded steps go over it)."""
        return self.groups[worker][0]

    def check(self) -> None:
        """Every connection must still be the one that learned its worker."""
        _common.check_connections(self.groups)

    def close(self) -> None:
        for connection in itertools.chain(*self.groups.values()):
            connection.close()


class Batches:
    """One batch of each class for round ``r``; rotates claimants and forwarding workers."""

    def __init__(self, file_host: Host, redis_hosts: list[Host]) -> None:
        self.file_host = file_host
        self.redis_hosts = redis_hosts
        # Every Redis worker with its host, in a fixed order.
        self.redis_workers = [(h, w) for h in redis_hosts for w in h.workers]

    def local_file(self, r: int, n: int, into: list[float]) -> None:
        host = self.file_host
        host.local(host.workers[r % len(host.workers)], n, into)

    def forwarded_file(self, r: int, n: int, into: list[float]) -> None:
        host = self.file_host
        owner = host.workers[r % len(host.workers)]
        via = host.workers[(r + 1) % len(host.workers)]
        host.sessions[owner].checked_steps(host.connection_of(via), n, into, via=via)

    def local_redis(self, r: int, n: int, into: list[float]) -> None:
        host, owner = self.redis_workers[r % len(self.redis_workers)]
        host.local(owner, n, into)

    def forwarded_redis_same(self, r: int, n: int, into: list[float]) -> None:
        host, owner = self.redis_workers[r % len(self.redis_workers)]
        via = next(w for w in host.workers if w != owner)
        host.sessions[owner].checked_steps(host.connection_of(via), n, into, via=via)

    def forwarded_redis_other(self, r: int, n: int, into: list[float]) -> None:
        host, owner = self.redis_workers[r % len(self.redis_workers)]
        other = next(h for h in self.redis_hosts if h is not host)
        # Rotate the forwarding worker on the other host too.
        via = other.workers[(r // len(self.redis_workers)) % len(other.workers)]
        host.sessions[owner].checked_steps(other.connection_of(via), n, into, via=via)

    def by_class(self) -> dict[str, Callable[[int, int, list[float]], None]]:
        return {
            LOCAL_FILE: self.local_file,
            FORWARDED_FILE: self.forwarded_file,
            LOCAL_REDIS: self.local_redis,
            FORWARDED_REDIS_SAME: self.forwarded_redis_same,
            FORWARDED_REDIS_OTHER: self.forwarded_redis_other,
        }


def signature_cost(calls: int = 20000) -> dict[str, dict[str, float]]:
    """In-process microseconds to sign and to verify a forwarded ``/step`` (`ForwardSigner`)."""
    signer = ForwardSigner(secrets.token_hex(32))
    cookie = b"gym_session=" + secrets.token_urlsafe(150).encode()  # about a real cookie's size
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/step",
        "raw_path": b"/step",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"cookie", cookie)],
    }
    body = b'{"action": 1}'
    clock = time.perf_counter_ns
    sign, verify = [], []
    for _ in range(calls):
        started = clock()
        header = signer.header(scope, body, "w-target")
        sign.append((clock() - started) / 1000)
        signed = {**scope, "headers": [*scope["headers"], header]}
        started = clock()
        signer.verify_body(signer.verify_head(signed, "w-target"), body)
        verify.append((clock() - started) / 1000)
    return {"sign_us": _common.summary(sign), "verify_us": _common.summary(verify)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=200, help="unrecorded steps per class")
    args = _common.parse_args(parser)
    _common.needs("redis-server", "redis-server", "cross_host")
    print(_common.load_note())
    machine = _common.machine()  # before the run: its load average is the one at the start
    started = time.monotonic()

    with contextlib.ExitStack() as stack:
        redis_server = stack.enter_context(run_redis())
        client = redis.Redis.from_url(redis_server.url)
        stack.callback(client.close)
        secret = secrets.token_hex(32)
        redis_args = ("--claims", redis_server.url, "--debug-worker-header")
        redis_servers = [
            stack.enter_context(
                start_server(TARGET, *redis_args, workers=WORKERS_PER_SERVER, secret=secret)
            )
            for _ in range(HOSTS)
        ]
        file_server = stack.enter_context(
            start_server(
                TARGET,
                "--debug-worker-header",
                *_common.hop_only_args(),
                workers=WORKERS_PER_SERVER,
            )
        )
        registered = wait_for_registrations(redis_server.url, HOSTS * WORKERS_PER_SERVER)

        hosts: list[Host] = []
        for name, server in [("file", file_server)] + [
            (f"redis host {i + 1}", s) for i, s in enumerate(redis_servers)
        ]:
            hosts.append(Host(name, server))
            stack.callback(hosts[-1].close)
        file_host, redis_hosts = hosts[0], hosts[1:]
        seen = {w for h in redis_hosts for w in h.workers}
        if seen != registered:
            raise RuntimeError(f"workers answering {seen} are not those registered {registered}")
        claim_keys = sum(1 for _ in client.scan_iter(match="gym_sessions:claim:*", count=1000))
        if claim_keys != len(seen):
            raise RuntimeError(f"{claim_keys} claims in Redis for {len(seen)} sessions")

        plan = Batches(file_host, redis_hosts)
        batches = plan.by_class()
        cycle = len(plan.redis_workers)
        batches = {kind: batches[kind] for kind in CLASSES}  # in CLASSES' order
        per_round = interleaved_rounds(
            batches, cycle=cycle, warmup=args.warmup, rounds=args.rounds, batch=args.batch
        )
        for host in hosts:
            host.check()
        if registered_workers(redis_server.url) != registered:
            raise RuntimeError("the registered workers changed during the run")
        redis_info = client.info("server")["redis_version"]
        commands = {
            name.removeprefix("cmdstat_"): stats["calls"]
            for name, stats in client.info("commandstats").items()
        }

    report = summarize(per_round, args, machine)
    report["signature_in_process"] = signature_cost()
    report["redis"] = f"redis-server {redis_info}"
    report["redis_commands_during_run"] = commands
    report["seconds_total"] = time.monotonic() - started
    print_report(report)
    path = _common.write_json("cross_host", report)
    plot(per_round)
    print(f"\nwrote {path} and cross_host.png ({report['seconds_total']:.0f} s in all)")


def summarize(
    per_round: dict[str, list[list[float]]], args: argparse.Namespace, machine: dict[str, Any]
) -> dict[str, Any]:
    pooled = {k: _common.summary([x for b in per_round[k] for x in b]) for k in CLASSES}
    p50s = {k: [_common.percentile(b, 50) for b in per_round[k]] for k in CLASSES}
    p99s = {k: [_common.percentile(b, 99) for b in per_round[k]] for k in CLASSES}
    ratios: dict[str, dict[str, float]] = {}
    for kind in CLASSES:
        ratios[kind] = {
            "over_local_file_p50": _common.median_ratio(p50s[kind], p50s[LOCAL_FILE]),
            "over_local_file_p99": _common.median_ratio(p99s[kind], p99s[LOCAL_FILE]),
        }
        base = BASELINE.get(kind)
        if base is not None:
            ratios[kind]["over_own_local_p50"] = _common.median_ratio(p50s[kind], p50s[base])
            ratios[kind]["over_own_local_p99"] = _common.median_ratio(p99s[kind], p99s[base])
            ratios[kind]["added_p50_ms"] = statistics.median(
                f - lo for f, lo in zip(p50s[kind], p50s[base], strict=True)
            )
    ratios[FORWARDED_REDIS_OTHER]["over_forwarded_file_p50"] = _common.median_ratio(
        p50s[FORWARDED_REDIS_OTHER], p50s[FORWARDED_FILE]
    )
    ratios[FORWARDED_REDIS_OTHER]["over_forwarded_redis_same_host_p50"] = _common.median_ratio(
        p50s[FORWARDED_REDIS_OTHER], p50s[FORWARDED_REDIS_SAME]
    )
    return {
        "machine": machine,
        "rounds": args.rounds,
        "batch": args.batch,
        "warmup": args.warmup,
        "workers_per_server": WORKERS_PER_SERVER,
        "unit": "ms per request, client-side wall time of one sequential /step",
        "classified_by": "x-gym-worker / x-gym-forwarded-by reply headers (--debug-worker-header)",
        "pooled": pooled,
        "per_round_p50": p50s,
        "per_round_p99": p99s,
        "ratios_median_of_rounds": ratios,
    }


def print_report(report: dict[str, Any]) -> None:
    pooled, ratios = report["pooled"], report["ratios_median_of_rounds"]
    print(
        f"\n/step latency, one kept-alive connection, sequential; {report['rounds']} interleaved "
        f"rounds x {report['batch']} steps per class; servers of {WORKERS_PER_SERVER} workers "
        f"({report['machine']['nproc']} cpus)\n"
    )
    rows = []
    for kind in CLASSES:
        s, r = pooled[kind], ratios[kind]
        own = (
            f"{r['over_own_local_p50']:.2f} / {r['over_own_local_p99']:.2f}"
            if "over_own_local_p50" in r
            else ""
        )
        added = f"{r['added_p50_ms']:.3f}" if "added_p50_ms" in r else ""
        rows.append(
            [
                kind,
                s["n"],
                f"{s['p50']:.3f}",
                f"{s['p99']:.3f}",
                f"{r['over_local_file_p50']:.2f} / {r['over_local_file_p99']:.2f}",
                own,
                added,
            ]
        )
    print(
        markdown_table(
            [
                "class",
                "requests",
                "p50 ms",
                "p99 ms",
                "/ local file, p50 / p99",
                "/ local same config, p50 / p99",
                "added p50 ms",
            ],
            rows,
        )
    )
    other = ratios[FORWARDED_REDIS_OTHER]
    print(
        "\n(ratios and added latency: median of per-round values)\n"
        f"cross-host hop / one-host file hop, p50: {other['over_forwarded_file_p50']:.2f}\n"
        f"cross-host hop / one-host Redis hop, p50: "
        f"{other['over_forwarded_redis_same_host_p50']:.2f}"
    )
    signature = report["signature_in_process"]
    print(
        f"forward signature, in process: sign p50 {signature['sign_us']['p50']:.1f} us, "
        f"verify p50 {signature['verify_us']['p50']:.1f} us"
    )


def plot(per_round: dict[str, list[list[float]]]) -> None:
    _common.latency_cdf(
        "cross_host",
        per_round,
        "One tool call: local, forwarded on one host, forwarded to another host",
        legend_size=7,
    )


if __name__ == "__main__":
    main()
