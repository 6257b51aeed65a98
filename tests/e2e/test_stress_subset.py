"""Every stress check at a few hundred, in the default suite (the full run is opt-in)."""

from __future__ import annotations

import pytest

from tests.conftest import require_or_skip
from tests.stress.run import SMALL, format_table, run_multihost_suite, run_suite

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(600)
def test_every_stress_check_passes_at_small_sizes():
    rows = run_suite(SMALL)
    table = format_table(rows)
    print("\n" + table)
    failed = [row.as_dict() for row in rows if not row.ok]
    assert failed == [], table
    assert len(rows) == 9


@pytest.mark.timeout(600)
def test_load_balanced_checks_pass_on_two_hosts_with_redis_claims_at_small_sizes():
    require_or_skip("redis-server", "redis-server")
    require_or_skip("nginx", "nginx")
    rows = run_multihost_suite(SMALL)
    table = format_table(rows)
    print("\n" + table)
    assert [row.as_dict() for row in rows if not row.ok] == [], table
    assert len(rows) == 8
