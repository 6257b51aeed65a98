"""Cost of `OwnedClaims.owner()`: this worker's claims (memory) vs another worker's (a file read).

In-process, no server: two `FileClaimStore` s share a claims directory in a
temporary directory under /tmp (the filesystem of a real server's runtime
directory); worker "w1" owns half of the sessions, worker "w2" the other half,
and ``w1``'s `OwnedClaims.owner()` is timed for

- own claims (the dict lookup every local request does),
- another worker's claims (`FileClaimStore.read`: open, read, close; every
  forwarded request does this on the accepting worker),
- unclaimed ids (the file is missing; every session start and minted id),

plus `FileClaimStore.create` (a session start's claim). Each call is timed on its
own with ``time.perf_counter_ns`` (the timer's own cost is measured and shown,
not subtracted), and also in batches of 100 calls (mean per call).

    .venv/bin/python benchmarks/claim_lookup.py [--calls 20000] [--claims 2000]

Prints a Markdown table; writes benchmarks/results/claim_lookup.json and .png.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

import _common
from _common import markdown_table

from gym_sessions.routing.claim_store import FileClaimStore, claim_file_name
from gym_sessions.routing.owned_claims import OwnedClaims

BATCH = 100


def timed_each(call: Callable[[str], object], ids: list[str]) -> list[float]:
    """Nanoseconds of each ``call(id)``."""
    clock = time.perf_counter_ns
    samples = []
    for sid in ids:
        started = clock()
        call(sid)
        samples.append(clock() - started)
    return samples


def timed_batches(call: Callable[[str], object], ids: list[str]) -> list[float]:
    """Mean nanoseconds per call over consecutive batches of ``BATCH`` calls."""
    clock = time.perf_counter_ns
    samples = []
    for start in range(0, len(ids) - BATCH + 1, BATCH):
        chunk = ids[start : start + BATCH]
        started = clock()
        for sid in chunk:
            call(sid)
        samples.append((clock() - started) / BATCH)
    return samples


def read_buffered(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def read_raw(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 256)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per case")
    parser.add_argument("--claims", type=int, default=2000, help="claims each worker holds")
    args = parser.parse_args()
    print(_common.load_note())

    base = tempfile.mkdtemp(prefix="gs-claims-", dir="/tmp")
    try:
        claims_dir = os.path.join(base, "claims")
        os.mkdir(claims_dir, 0o700)
        mine = OwnedClaims(FileClaimStore(claims_dir, "w1"), "w1", window=300)
        theirs = OwnedClaims(FileClaimStore(claims_dir, "w2"), "w2", window=300)
        own_ids = [uuid.uuid4().hex for _ in range(args.claims)]
        other_ids = [uuid.uuid4().hex for _ in range(args.claims)]
        for sid in own_ids:
            assert mine.claim(sid) is None
        for sid in other_ids:
            assert theirs.claim(sid) is None
        assert mine.owner(own_ids[0]) == "w1" and mine.owner(other_ids[0]) == "w2"

        rng = random.Random(0)

        def paths(pool: list[str]) -> list[str]:
            return [os.path.join(claims_dir, claim_file_name(sid)) for sid in draw(pool)]

        def draw(pool: list[str]) -> list[str]:
            return [rng.choice(pool) for _ in range(args.calls)]

        unclaimed = [uuid.uuid4().hex for _ in range(args.calls)]
        fresh = [uuid.uuid4().hex for _ in range(args.calls)]
        creator = FileClaimStore(claims_dir, "w3")
        cases: dict[str, tuple[Callable[[str], object], list[str], list[str]]] = {
            "timer only (perf_counter_ns pair)": (lambda sid: None, draw(own_ids), draw(own_ids)),
            "owner(): own claim (memory)": (mine.owner, draw(own_ids), draw(own_ids)),
            "owner(): other worker's claim (file read)": (
                mine.owner,
                draw(other_ids),
                draw(other_ids),
            ),
            "owner(): unclaimed id (file missing)": (
                mine.owner,
                unclaimed,
                [uuid.uuid4().hex for _ in range(args.calls)],
            ),
            "FileClaimStore.create (session start)": (creator.create, fresh, []),
            # Where a file read's time goes (not product code: the same steps, by hand).
            "part: claim_file_name (sha256 hex)": (claim_file_name, draw(other_ids), []),
            "part: open()+read() of a claim path (buffered)": (
                read_buffered,
                paths(other_ids),
                [],
            ),
            "alt: os.open+os.read+os.close of a claim path": (read_raw, paths(other_ids), []),
        }
        rows, report_cases = [], {}
        for label, (call, each_ids, batch_ids) in cases.items():
            if "create" not in label:  # warm caches; create() cannot repeat an id
                for sid in each_ids[:500]:
                    call(sid)
            each = [ns / 1000 for ns in timed_each(call, each_ids)]
            batched = [ns / 1000 for ns in timed_batches(call, batch_ids)] if batch_ids else []
            stats = _common.summary(each)
            report_cases[label] = {
                "each_us": stats,
                "batched_mean_us": _common.summary(batched) if batched else None,
            }
            rows.append(
                [
                    label,
                    f"{stats['p50']:.2f}",
                    f"{stats['p99']:.2f}",
                    f"{_common.percentile(batched, 50):.3f}" if batched else "",
                ]
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(
        f"\n{args.calls} calls per case, {args.claims} claims per worker, "
        f"claims directory on {filesystem('/tmp')} under /tmp\n"
    )
    print(
        markdown_table(
            ["case", "p50 us (each)", "p99 us (each)", f"p50 of {BATCH}-call batch means, us"],
            rows,
        )
    )
    own = report_cases["owner(): own claim (memory)"]["each_us"]["p50"]
    other = report_cases["owner(): other worker's claim (file read)"]["each_us"]["p50"]
    print(f"\ntargets: own <= 1 us p50 (measured {own:.2f}), other <= 10 us p50 ({other:.2f})")
    report = {
        "machine": _common.machine(),
        "calls": args.calls,
        "claims_per_worker": args.claims,
        "filesystem": filesystem("/tmp"),
        "cases": report_cases,
        "targets_us_p50": {"own": 1.0, "other": 10.0},
    }
    path = _common.write_json("claim_lookup", report)

    def plot(axes):  # type: ignore[no-untyped-def]
        labels = [label for label in report_cases if label.startswith("owner") or "create" in label]
        values = [report_cases[label]["each_us"]["p50"] for label in labels]
        short = [label.replace(" (", "\n(", 1) for label in labels]
        _common.bars(axes, short, values, "p50 us per call", fmt="%.2f")
        axes.set_yscale("log")
        axes.set_title("Claim lookup cost per call (p50, individually timed)")

    _common.figure("claim_lookup", plot)
    print(f"wrote {path} and claim_lookup.png")


def filesystem(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            if path.startswith(mount_point) and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return kind


if __name__ == "__main__":
    main()
