"""Worker memory and CPU under oversized request heads and bodies, before and after issue 14.

Each attack runs against a fresh 4-worker counter server of each commit
(default: f720c20, before; HEAD, after), served from its own ``git worktree``
(`_common.start_revision_server` checks every process imported it):

- ``header value``: ``GET /health`` with one 64 MiB header value;
- ``header lines``: ``GET /health`` with 23 MiB of ``a: b`` header lines;
- ``url``: ``GET /health?`` with a 64 MiB query;
- ``body``: ``POST /reset`` with a 16 MiB body ``[{},{},...]`` (5.6 million objects);
- ``3 bodies``: three such bodies at once, on three connections the same worker
  accepted (the worst case for one worker's memory);
- ``3 int arrays``, ``3 strings``, ``3 batches``, ``3 binary``: three 16 MiB
  bodies at once on one worker, of other kinds: a ``/step`` action of small
  ints, a ``/reset`` whose task text is one long string, a ``/step_batch`` of
  many entries, a ``/step`` in the binary values encoding (one noise blob);
- ``6 bodies, idle``: six such bodies one after another (never more than one in
  flight), each on its own connection to the same worker, each connection
  then left open and idle (clients may keep a connection 120 s).

The attacker sends on a raw socket while a thread reads whatever the server
answers; it stops sending when the server stops reading (or closes), and gives
up ``--bound`` seconds (60) after it started. Measured: what the server
answered and when; each worker's RSS before, its peak (``VmHWM``: the server is
fresh, so the peak is the attack's) and after; the CPU seconds the workers
spent (until their CPU time stops growing, at most ``--bound`` s); and honest
counter episodes played beside the attack on new connections (all must score
1.0; the slowest episode shows how long a worker stalled).

    .venv/bin/python benchmarks/attack_bounds.py [--commits f720c20 HEAD] [--bound 60]
        [--attacks header-value header-lines url body 3-bodies 6-bodies-idle]

Prints a Markdown table; writes attack_bounds.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import _common
from _common import connections_by_worker, markdown_table, port_of

from envs.counter_load import client_session, make_episodes, play
from gym_sessions.spaces.binary import frame
from gym_sessions.value_messages import BINARY_MEDIA_TYPE

TARGET = "envs.counter:CounterEnv"
WORKERS = 4
MIB = 1024 * 1024
CHUNK = 256 * 1024
CALIBRATION_EPISODES = 20
# Attacks on several connections that one worker accepted: how many.
SAME_WORKER = {
    "3-bodies": 3,
    "6-bodies-idle": 6,
    "3-int-arrays": 3,
    "3-strings": 3,
    "3-batches": 3,
    "3-binary": 3,
}
# What each body attack sends: its route, content type and body of 16 MiB.
BODY_ATTACKS = {"body", *SAME_WORKER}
SEQUENTIAL = {"6-bodies-idle"}
_TICKS = os.sysconf("SC_CLK_TCK")


def _filled(prefix: bytes, filler: bytes, size: int, suffix: bytes) -> Iterator[bytes]:
    """``prefix``, ``filler`` repeated up to ``size`` bytes, ``suffix``; in chunks."""
    yield prefix
    block = filler * max(1, CHUNK // len(filler))
    left = size
    while left > 0:
        piece = block[: min(left, len(block))]
        left -= len(piece)
        yield piece
    yield suffix


def _json_array_body(size: int) -> bytes:
    """``[{},{},...,{}]`` of exactly ``size`` bytes (``size`` = 1 + 3k + 3)."""
    objects = (size - 4) // 3
    body = b"[" + b"{}," * objects + b"{}]"
    return body + b" " * (size - len(body))  # whitespace pads to the exact size


def _body_attack(kind: str, size: int) -> tuple[bytes, bytes, bytes]:
    """Route, content type and body (just under ``size`` bytes) of a body attack."""
    size -= 1024  # room for each body's wrapping: all stay within --max-body-bytes
    if kind == "3-int-arrays":  # an action of small ints, as a MultiDiscrete one
        return b"/step", b"application/json", b'{"action": [' + b"1," * (size // 2 - 8) + b"1]}"
    if kind == "3-strings":  # task text
        return b"/reset", b"application/json", b'{"options": {"text": "' + b"x" * size + b'"}}'
    if kind == "3-batches":
        entry = b'{"session_id": "0123456789abcdef0123456789abcdef", "action": 1},'
        entries = entry * (size // len(entry) - 1) + entry[:-1]
        return b"/step_batch", b"application/json", b'{"entries": [' + entries + b"]}"
    if kind == "3-binary":  # a frame whose one blob is noise
        head = b'{"action": {"tree": {"buffer": 0, "dtype": "|u1", "shape": [%d]}}}' % size
        blob = os.urandom(size)
        return b"/step", BINARY_MEDIA_TYPE.encode(), frame(head, [blob])
    return b"/reset", b"application/json", _json_array_body(size + 1024)


def attack_chunks(kind: str) -> tuple[Iterator[bytes], int]:
    """The bytes an attack sends (as chunks) and their total."""
    if kind == "header-value":
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
        return _filled(head, b"a", 64 * MIB, b"\r\n\r\n"), len(head) + 64 * MIB + 4
    if kind == "header-lines":
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
        return _filled(head, b"a: b\r\n", 23 * MIB, b"\r\n"), len(head) + 23 * MIB + 2
    if kind == "url":
        tail = b" HTTP/1.1\r\nHost: x\r\n\r\n"
        return _filled(b"GET /health?", b"q", 64 * MIB, tail), 12 + 64 * MIB + len(tail)
    if kind in BODY_ATTACKS:
        path, content_type, body = _body_attack(kind, 16 * MIB)
        head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            path,
            content_type,
            len(body),
        )
        view = memoryview(body)
        chunks = [head] + [bytes(view[i : i + CHUNK]) for i in range(0, len(body), CHUNK)]
        return iter(chunks), len(head) + len(body)
    raise ValueError(kind)


class Attacker:
    """Sends one attack on ``sock`` while a thread reads the server's answer (bounded in time)."""

    def __init__(self, sock: socket.socket, kind: str, bound: float) -> None:
        self.sock = sock
        self.kind = kind
        self.bound = bound
        self.sent = 0
        self.reply = b""
        self.first_reply_after: float | None = None
        self.closed_after: float | None = None
        self.send_stopped: str = ""
        self.started = 0.0

    def run(self) -> dict[str, Any]:
        self.sock.settimeout(1.0)
        self.started = time.monotonic()
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        chunks, total = attack_chunks(self.kind)
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    if time.monotonic() - self.started > self.bound:
                        raise TimeoutError
                    if self.closed_after is not None:
                        raise ConnectionResetError("the server closed the connection")
                    try:
                        n = self.sock.send(view)
                    except TimeoutError:
                        continue  # the server is not reading right now
                    view = view[n:]
                    self.sent += n
            self.send_stopped = "sent everything"
        except TimeoutError:
            self.send_stopped = f"gave up sending after {self.bound:.0f} s"
        except OSError as exc:
            self.send_stopped = f"server stopped reading ({type(exc).__name__})"
        reader.join(max(0.0, self.bound - (time.monotonic() - self.started)) + 1.0)
        if reader.is_alive():
            self.sock.close()  # the bound: stop waiting for a reply
            reader.join(5)
        status = self.reply.split(b"\r\n", 1)[0].decode("latin-1") if self.reply else ""
        return {
            "bytes_to_send": total,
            "bytes_sent": self.sent,
            "sending": self.send_stopped,
            "reply_status_line": status,
            "reply_body": self._reply_body(),
            "first_reply_byte_after_s": self.first_reply_after,
            "closed_by_server_after_s": self.closed_after,
        }

    def _reply_body(self) -> str:
        _, _, body = self.reply.partition(b"\r\n\r\n")
        return body[:300].decode("latin-1")

    def _reply_complete(self) -> bool:
        head, found, body = self.reply.partition(b"\r\n\r\n")
        if not found:
            return False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return len(body) >= int(value)
        return False

    def _read(self) -> None:
        while time.monotonic() - self.started < self.bound + 1.0:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.closed_after = time.monotonic() - self.started
                return
            if self.first_reply_after is None:
                self.first_reply_after = time.monotonic() - self.started
            self.reply += chunk
            if self._reply_complete():
                return  # a whole reply: the attack got its answer


class Honest:
    """Counter episodes on new connections while the attack runs, at most one per ``pace`` s."""

    def __init__(self, url: str, pace: float = 0.2, episodes: int | None = None) -> None:
        self.url = url
        self.pace = pace
        self.limit = episodes
        self.stop = threading.Event()
        self.results: list[tuple[float | None, float]] = []  # (reward, seconds)
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        seed = 0
        async with client_session() as client:
            while not self.stop.is_set() and len(self.results) != self.limit:
                seed += 1
                (episode,) = make_episodes(1, seed=int(time.time() * 1000) + seed)
                began = time.monotonic()
                try:
                    await play(client, self.url, episode)
                except Exception:
                    episode.reward = None
                took = time.monotonic() - began
                self.results.append((episode.reward, took))
                await asyncio.sleep(max(0.0, self.pace - took))

    def __enter__(self) -> Honest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.limit is None:
            self.stop.set()
        self.thread.join(150)

    def summary(self) -> dict[str, Any]:
        rewards = [r for r, _ in self.results]
        return {
            "episodes": len(self.results),
            "scored_1": sum(r == 1.0 for r in rewards),
            "slowest_episode_s": max((s for _, s in self.results), default=None),
        }


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0])
    return fields


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _settle(pids: list[int], bound: float) -> float:
    """Wait until the workers' CPU time stops growing (0.5 s without 20 ms more); seconds waited."""
    began = time.monotonic()
    last = sum(_cpu(p) for p in pids)
    while time.monotonic() - began < bound:
        time.sleep(0.5)
        now = sum(_cpu(p) for p in pids)
        if now - last < 0.02:
            break
        last = now
    return time.monotonic() - began


def run_attack(revision: _common.Revision, kind: str, bound: float) -> dict[str, Any]:
    server = _common.start_revision_server(revision, TARGET, workers=WORKERS)
    try:
        pids = server.worker_pids()
        sockets: list[socket.socket] = []
        keep: list[Any] = []
        if kind in SAME_WORKER:
            groups = connections_by_worker(server.url, WORKERS, per_worker=SAME_WORKER[kind])
            target_worker = sorted(groups)[0]
            for worker, connections in groups.items():
                if worker == target_worker:
                    keep += connections
                else:
                    for connection in connections:
                        connection.close()
            sockets = [c.connection.sock for c in keep]
        else:
            sockets = [socket.create_connection(("127.0.0.1", port_of(server.url)), timeout=10)]
        attacked = {
            _common.accepting_pid(server.process.pid, port_of(server.url), s.getsockname()[1])
            for s in sockets
        }
        # What one honest episode costs the workers, to take out of the attack's CPU.
        cpu_calibration = sum(_cpu(p) for p in pids)
        with Honest(server.url, episodes=CALIBRATION_EPISODES):
            pass
        cpu_per_episode = (sum(_cpu(p) for p in pids) - cpu_calibration) / CALIBRATION_EPISODES
        time.sleep(0.5)
        before = {pid: _status(pid) for pid in pids}
        cpu_before = {pid: _cpu(pid) for pid in pids}
        began = time.monotonic()
        with Honest(server.url) as honest:
            attackers = [Attacker(s, kind, bound) for s in sockets]
            outcomes: list[dict] = [{} for _ in attackers]

            def attack(index: int) -> None:
                outcomes[index] = attackers[index].run()

            if kind in SEQUENTIAL:  # one at a time; each connection then stays open, idle
                for index in range(len(attackers)):
                    attack(index)
            else:
                threads = [
                    threading.Thread(target=attack, args=(i,)) for i in range(len(attackers))
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(bound + 30)
        settled = _settle(pids, bound)
        elapsed = time.monotonic() - began
        after = {pid: _status(pid) for pid in pids}
        cpu_after = {pid: _cpu(pid) for pid in pids}
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        for connection in keep:
            connection.close()
        workers = {
            str(pid): {
                "attacked": pid in attacked,
                "rss_before_mib": before[pid]["VmRSS"] / 1024,
                "peak_rss_mib": after[pid]["VmHWM"] / 1024,
                "rss_after_mib": after[pid]["VmRSS"] / 1024,
                "cpu_s": cpu_after[pid] - cpu_before[pid],
            }
            for pid in pids
        }
        alive = all(os.path.exists(f"/proc/{pid}") for pid in pids)
        return {
            "revision": revision.label,
            "commit": revision.commit,
            "attack": kind,
            "attackers": outcomes,
            "workers": workers,
            "peak_rss_growth_mib_max": max(
                w["peak_rss_mib"] - w["rss_before_mib"] for w in workers.values()
            ),
            "worker_cpu_s_total": sum(w["cpu_s"] for w in workers.values()),
            "honest_cpu_s_per_episode": cpu_per_episode,
            "worker_cpu_s_attack": sum(w["cpu_s"] for w in workers.values())
            - cpu_per_episode * len(honest.results),
            "seconds_until_cpu_settled_after_attack": settled,
            "seconds": elapsed,
            "workers_alive_after": alive,
            "honest": honest.summary(),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", nargs="+", default=["f720c20", "HEAD"])
    parser.add_argument("--bound", type=float, default=60.0, help="seconds per attack")
    parser.add_argument(
        "--attacks",
        nargs="+",
        default=["header-value", "header-lines", "url", "body", *SAME_WORKER],
    )
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    results = []
    with _common.worktrees(args.commits) as revisions:
        for kind in args.attacks:
            for revision in revisions:
                result = run_attack(revision, kind, args.bound)
                results.append(result)
                print(one_line(result), flush=True)
    report = {
        "machine": machine,
        "bound_seconds": args.bound,
        "commits": {r.label: r.commit for r in revisions},
        "results": results,
    }
    print()
    print(table(results))
    path = _common.write_json("attack_bounds", report)
    print(f"\nwrote {path}")


def one_line(result: dict) -> str:
    answers = "; ".join(
        f"{a['reply_status_line'] or 'no reply'} after {a['bytes_sent'] / MIB:.1f} MiB"
        for a in result["attackers"]
    )
    growth = result["peak_rss_growth_mib_max"]
    return (
        f"{result['attack']:13} {result['revision']:8} peak +{growth:.0f} MiB, "
        f"CPU {result['worker_cpu_s_attack']:.1f} s; {answers}"
    )


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        attacked = [w for w in r["workers"].values() if w["attacked"]] or list(
            r["workers"].values()
        )
        answers = ", ".join(
            sorted(
                {(a["reply_status_line"].split(" ", 1)[-1] or "no reply") for a in r["attackers"]}
            )
        )
        sent = ", ".join(f"{a['bytes_sent'] / MIB:.1f}" for a in r["attackers"])
        reply_after = ", ".join(
            "-" if a["first_reply_byte_after_s"] is None else f"{a['first_reply_byte_after_s']:.1f}"
            for a in r["attackers"]
        )
        honest = r["honest"]
        rows.append(
            [
                r["attack"],
                f"{r['revision']} ({r['commit'][:7]})",
                answers,
                sent,
                reply_after,
                f"{max(w['peak_rss_mib'] - w['rss_before_mib'] for w in attacked):.0f}",
                f"{max(w['rss_after_mib'] - w['rss_before_mib'] for w in attacked):.0f}",
                f"{max(0.0, r['worker_cpu_s_attack']):.2f}",
                f"{honest['scored_1']}/{honest['episodes']}",
                f"{honest['slowest_episode_s']:.2f}" if honest["slowest_episode_s"] else "-",
            ]
        )
    headers = [
        "attack",
        "commit",
        "answer",
        "MiB sent",
        "answer after s",
        "attacked worker peak RSS growth MiB",
        "its RSS growth after, connections open, MiB",
        "worker CPU s (honest episodes' taken out)",
        "honest episodes 1.0",
        "slowest honest episode s",
    ]
    return markdown_table(headers, rows)


if __name__ == "__main__":
    main()
