"""The stress suite at the reference's sizes: opt in with ``GYM_SESSIONS_STRESS=1`` (minutes)."""

from __future__ import annotations

import os

import pytest

from tests.stress.run import FULL, format_table, run_multihost_suite, run_suite

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("GYM_SESSIONS_STRESS") != "1",
        reason="the full stress run takes minutes: set GYM_SESSIONS_STRESS=1",
    ),
]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("env_workers", [4, 8])
def test_every_stress_check_passes_at_reference_sizes(env_workers):
    rows = run_suite(FULL, env_workers=env_workers)
    print("\n" + format_table(rows))
    assert [row.check for row in rows if not row.ok] == []


@pytest.mark.timeout(3600)
def test_every_load_balanced_check_passes_on_two_hosts_with_redis_claims():
    rows = run_multihost_suite(FULL)
    print("\n" + format_table(rows))
    assert [row.check for row in rows if not row.ok] == []
