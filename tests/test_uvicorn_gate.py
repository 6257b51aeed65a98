"""The uvicorn gate: handoff and coalesced replies run only on the uvicorn versions they were
tested with (`TESTED_UVICORN`); on any other, both are off and everything else runs as before.

``make uvicorn-latest`` runs this and the protocol tests on the newest uvicorn;
``tests/e2e/test_handoff_e2e.py`` has the gate end to end (the log line, the hop).
"""

import pytest
import uvicorn

from gym_sessions.transport.http_protocol import TESTED_UVICORN, BoundedHttpProtocol, uvicorn_tested
from gym_sessions.transport.private_listener import PrivateHttpProtocol


def test_the_gate_opens_for_the_tested_minor_versions_only():
    major, minor = TESTED_UVICORN[-1]
    assert uvicorn_tested(f"{major}.{minor}.0") and uvicorn_tested(f"{major}.{minor}.7")
    assert not uvicorn_tested(f"{major}.{minor + 1}.0")
    assert not uvicorn_tested(f"{major + 1}.0.0")
    assert not uvicorn_tested("not-a-version")


def test_the_protocols_follow_the_gate_of_the_installed_uvicorn(request):
    if request.config.getoption("--open-uvicorn-gate"):
        pytest.skip("--open-uvicorn-gate opened it on purpose")
    tested = uvicorn_tested(uvicorn.__version__)
    assert BoundedHttpProtocol.handoff_enabled is tested
    assert BoundedHttpProtocol.coalesces_replies is tested
    assert not PrivateHttpProtocol.coalesces_replies  # the hop's replies never coalesce
