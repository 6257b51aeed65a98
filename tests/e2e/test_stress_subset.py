"""Every stress check at a few hundred, in the default suite (the full run is opt-in).

``GYM_SESSIONS_STRESS_HOG=1`` runs each subset several times (3, or
``GYM_SESSIONS_STRESS_HOG_RUNS``) while one busy loop per core, in other
processes (tests/stress/hog.py), keeps every core busy: no check may depend on
how fast the machine is. About 1 minute per run on 2 cores; off by default.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.conftest import require_or_skip
from tests.stress.hog import cpu_hog, hog_requested
from tests.stress.run import SMALL, format_table, run_multihost_suite, run_suite

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # minutes in all: run by make test-slow

HOGGED = hog_requested()
RUNS = int(os.environ.get("GYM_SESSIONS_STRESS_HOG_RUNS", "3")) if HOGGED else 1
TIMEOUT = 600 * RUNS if HOGGED else 600


def _each_run(suite, expected_rows: int) -> None:
    """Run ``suite`` ``RUNS`` times (under the hog if asked); every row of every run must pass."""
    tables, failed = [], []
    hog = cpu_hog(seconds=TIMEOUT) if HOGGED else contextlib.nullcontext()
    with hog:
        for run in range(RUNS):
            rows = suite()
            tables.append(f"run {run + 1} of {RUNS}:\n{format_table(rows)}")
            print("\n" + tables[-1])
            failed += [(run + 1, row.as_dict()) for row in rows if not row.ok]
            assert len(rows) == expected_rows
    assert failed == [], "\n\n".join(tables)


@pytest.mark.timeout(TIMEOUT)
def test_every_stress_check_passes_at_small_sizes():
    _each_run(lambda: run_suite(SMALL), expected_rows=9)


@pytest.mark.timeout(TIMEOUT)
def test_load_balanced_checks_pass_on_two_hosts_with_redis_claims_at_small_sizes():
    require_or_skip("redis-server", "redis-server")
    require_or_skip("nginx", "nginx")
    # Five load-balanced checks, the cheap multi-host faults, three "nothing left" rows.
    _each_run(lambda: run_multihost_suite(SMALL), expected_rows=8 + len(SMALL.faults))
