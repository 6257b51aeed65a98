"""Every stress check at a few hundred, in the default suite (the full run is opt-in)."""

from __future__ import annotations

import pytest

from tests.stress.run import SMALL, format_table, run_suite

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(600)
def test_every_stress_check_passes_at_small_sizes():
    rows = run_suite(SMALL)
    table = format_table(rows)
    print("\n" + table)
    failed = [row.as_dict() for row in rows if not row.ok]
    assert failed == [], table
    assert len(rows) == 9
