"""Two commits side by side: ``/step`` local and forwarded at 2 workers, interleaved rounds.

One 2-worker counter server per commit (its own ``git worktree``, every
process checked to import it; ``--handoff off``, so a forwarded connection
stays forwarded), a kept-alive connection accepted by the session's holder
(*local*) and one accepted by the other worker (*forwarded*). Each round runs
a batch of sequential steps per class, the commits' order alternating; the
figures are medians of per-round p50 values and ratios.

    .venv/bin/python benchmarks/commit_ab.py A B [--rounds 30] [--batch 100]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import _common
from _common import RawConnection, markdown_table, session_cookie

KINDS = ("local", "forwarded")


class HeldSession:
    """A counter session and two connections to its server: one to its holder, one to the other."""

    def __init__(self, url: str) -> None:
        self.local = RawConnection(url)
        status, reply, response = self.local.request("POST", "/reset", {"seed": 0})
        if status != 200:
            raise RuntimeError(f"reset failed: {status} {reply}")
        self.headers = {"Cookie": f"{_common.COOKIE}={session_cookie(response)}"}
        self.forwarded = RawConnection(url)
        while self.forwarded.worker == self.local.worker:
            self.forwarded.close()
            self.forwarded = RawConnection(url)

    def steps(self, kind: str, n: int) -> list[float]:
        connection = self.local if kind == "local" else self.forwarded
        seconds = []
        for _ in range(n):
            begin = time.perf_counter()
            status, reply, _ = connection.request("POST", "/step", {"action": 1}, self.headers)
            seconds.append(time.perf_counter() - begin)
            if status != 200:
                raise RuntimeError(f"step failed: {status} {reply}")
        return seconds

    def close(self) -> None:
        self.local.close()
        self.forwarded.close()


def run(commits: list[str], rounds: int, batch: int, warmup: int) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        revisions = stack.enter_context(_common.worktrees(commits))
        sessions: dict[str, HeldSession] = {}
        for revision in revisions:
            server = stack.enter_context(
                _common.start_revision_server(
                    revision, "envs.counter:CounterEnv", "--handoff", "off", workers=2
                )
            )
            sessions[revision.label] = session = HeldSession(server.url)
            stack.callback(session.close)
        for session in sessions.values():
            for kind in KINDS:
                session.steps(kind, warmup)
        p50s: dict[str, list[float]] = {f"{c} {k}": [] for c in commits for k in KINDS}
        for r in range(rounds):
            for commit in commits if r % 2 == 0 else commits[::-1]:
                for kind in KINDS:
                    samples = sessions[commit].steps(kind, batch)
                    p50s[f"{commit} {kind}"].append(statistics.median(samples) * 1e3)
    a, b = commits
    return {
        "commits": {r.label: r.commit for r in revisions},
        "rounds": rounds,
        "batch": batch,
        "round_p50_ms": p50s,
        "median_p50_ms": {name: statistics.median(v) for name, v in p50s.items()},
        "forwarded_over_local": {
            c: _common.median_ratio(p50s[f"{c} forwarded"], p50s[f"{c} local"]) for c in commits
        },
        "a_over_b": {k: _common.median_ratio(p50s[f"{a} {k}"], p50s[f"{b} {k}"]) for k in KINDS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("commits", nargs=2, metavar="REV")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=300, help="unrecorded steps per class")
    args = _common.parse_args(parser)
    print(_common.load_note())
    report = {
        "machine": _common.machine(),
        **run(args.commits, args.rounds, args.batch, args.warmup),
    }
    a, b = args.commits
    rows = [[name, f"{ms:.3f}"] for name, ms in report["median_p50_ms"].items()]
    print(markdown_table(["class", "p50 ms (median of rounds)"], rows))
    for commit, ratio in report["forwarded_over_local"].items():
        print(f"{commit}: forwarded / local {ratio:.3f}")
    for kind, ratio in report["a_over_b"].items():
        print(f"{kind}: {a} / {b} {ratio:.3f}")
    print(_common.load_note())
    print("wrote", _common.write_json("commit_ab", report))


if __name__ == "__main__":
    main()
