"""The pure pieces of the operator metrics, in process (`gym_sessions.metrics`).

Route labels, the page one app renders and its parsing, the median estimate,
the access rule, and the ``status`` table. The app here is a real single-worker
`WorkerApp` around the counter env driven with hand-built ASGI messages, so no
socket is opened: that is how a non-loopback client can be tried on a machine
whose only reachable addresses are loopback ones. Workers added up across
processes are tested in ``tests/e2e/test_metrics.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from envs.counter import CounterEnv
from gym_sessions.errors import ForbiddenError, InvalidRequestError, InvalidTokenError, StartupError
from gym_sessions.metrics import CONTENT_TYPE, MetricsAccess, WorkerMetrics
from gym_sessions.metrics.access import is_loopback
from gym_sessions.metrics.recorder import RouteLabels
from gym_sessions.metrics.status import estimate_quantile, parse_samples, status_table
from gym_sessions.scope_keys import Served
from gym_sessions.secret_source import read_secret_file
from gym_sessions.server.app import WorkerApp
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.settings import Settings
from tests.asgi import asgi_request

SECRET = "metrics-unit-test-secret-" + "x" * 20
TOKEN = "t" * 40


async def asgi_get(app: WorkerApp, path: str, *, method: str = "GET", **request: Any) -> Any:
    """``asgi_request`` with the method last: most requests here are ``GET``."""
    return await asgi_request(app, method, path, **request)


def counter_app(**settings: Any) -> WorkerApp:
    return WorkerApp(GymEnvServer(CounterEnv), Settings(secret=SECRET, **settings))


def values(page: bytes, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples named ``name`` on ``page``: sorted labels -> value."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for s in parse_samples(page.decode())
        if s.name == name
    }


# Route labels --------------------------------------------------------------------------------


def test_route_labels_are_templates_never_raw_paths():
    labels = RouteLabels(["/step", "/reset", "/health"])
    assert labels("/step") == "/step"
    assert labels("/rollouts/abc/step") == "/rollouts/{rollout_id}/step"
    assert labels("/rollouts/another-one/reset") == "/rollouts/{rollout_id}/reset"
    assert labels("/step/") == "unmatched"
    assert labels("/rollouts/abc/nope") == "unmatched"
    assert labels("/" + "x" * 500) == "unmatched"


# The page of one app -------------------------------------------------------------------------


def test_one_app_renders_what_it_recorded_without_created_samples():
    metrics = WorkerMetrics("w-1", ["/step", "/reset"])
    assert not metrics.multiprocess  # no shared directory in this process
    for _ in range(3):
        metrics.request_done("/step", 200, Served.LOCAL)
    metrics.request_done("/rollouts/r7/step", 409, Served.FORWARDED)
    metrics.request_done("/what/ever", 404, Served.LOCAL)
    metrics.request_done("/reset", None, Served.LOCAL)  # the client left before any reply
    metrics.tool_call("step", "http", 0.0003)
    metrics.tool_call("step", "mcp", 0.002)
    metrics.session_expired()
    metrics.counts(5, 2)
    page = metrics.render()
    assert b"_created" not in page
    requests = values(page, "gym_sessions_requests_total")
    assert requests == {
        (("route", "/step"), ("status", "200")): 3,
        (("route", "/rollouts/{rollout_id}/step"), ("status", "409")): 1,
        (("route", "unmatched"), ("status", "404")): 1,
        (("route", "/reset"), ("status", "none")): 1,
    }
    served = values(page, "gym_sessions_worker_requests_total")
    assert served == {
        (("served", "local"), ("worker", "w-1")): 5,
        (("served", "forwarded"), ("worker", "w-1")): 1,
        (("served", "handed_over"), ("worker", "w-1")): 0,
    }
    refusals = values(page, "gym_sessions_session_refusals_total")
    assert refusals == {
        (("status", "409"), ("worker", "w-1")): 1,
        (("status", "410"), ("worker", "w-1")): 0,
    }
    assert values(page, "gym_sessions_expired_sessions_total") == {(("worker", "w-1"),): 1}
    assert values(page, "gym_sessions_claims") == {(("worker", "w-1"),): 5}
    assert values(page, "gym_sessions_open_sessions") == {(("worker", "w-1"),): 2}
    (info,) = values(page, "gym_sessions_worker_info")
    assert dict(info)["worker"] == "w-1" and dict(info)["pid"].isdigit()
    counts = values(page, "gym_sessions_tool_call_seconds_count")
    assert counts == {
        (("tool", "step"), ("via", "http"), ("worker", "w-1")): 1,
        (("tool", "step"), ("via", "mcp"), ("worker", "w-1")): 1,
    }
    buckets = values(page, "gym_sessions_tool_call_seconds_bucket")
    http = {dict(k)["le"]: v for k, v in buckets.items() if dict(k)["via"] == "http"}
    assert http["0.00025"] == 0 and http["0.0005"] == 1 and http["+Inf"] == 1


def test_label_values_are_escaped_on_the_page():
    metrics = WorkerMetrics('w"odd\\id\n', ["/step"])
    metrics.request_done("/step", 200, Served.LOCAL)
    page = metrics.render()
    served = values(page, "gym_sessions_worker_requests_total")
    assert served[(("served", "local"), ("worker", 'w"odd\\id\n'))] == 1


# The median ----------------------------------------------------------------------------------


def test_median_is_interpolated_inside_its_bucket():
    buckets = [(0.001, 0.0), (0.002, 10.0), (0.004, 20.0), (math.inf, 20.0)]
    assert estimate_quantile(buckets, 0.5) == pytest.approx(0.002)
    assert estimate_quantile(buckets, 0.25) == pytest.approx(0.0015)
    assert estimate_quantile(buckets, 0.75) == pytest.approx(0.003)


def test_median_in_the_open_bucket_is_the_highest_bound_and_none_without_data():
    assert estimate_quantile([(0.1, 1.0), (math.inf, 5.0)], 0.5) == 0.1
    assert estimate_quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5) is None
    assert estimate_quantile([], 0.5) is None


# Access --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.7", False),
        ("2001:db8::1", False),
        ("::ffff:192.0.2.7", False),
        ("localhost", False),  # ASGI gives addresses, never names
        ("", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool):
    assert is_loopback(host) is loopback


def _scope(client: tuple[str, int] | None, authorization: bytes | None = None) -> dict:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return {"client": client, "headers": headers}


def test_without_a_token_only_loopback_clients_are_answered():
    access = MetricsAccess()
    access.check(_scope(("127.0.0.1", 1)))
    access.check(_scope(("::1", 1)))
    with pytest.raises(ForbiddenError):
        access.check(_scope(("192.0.2.7", 1)))
    with pytest.raises(ForbiddenError):
        access.check(_scope(None))
    with pytest.raises(ForbiddenError):  # a bearer means nothing without a configured token
        access.check(_scope(("192.0.2.7", 1), b"Bearer " + TOKEN.encode()))


def test_with_a_token_every_client_needs_it_loopback_too():
    access = MetricsAccess(TOKEN)
    access.check(_scope(("192.0.2.7", 1), b"Bearer " + TOKEN.encode()))
    access.check(_scope(("127.0.0.1", 1), b"bearer  " + TOKEN.encode()))
    for authorization in [None, b"Bearer wrong", b"Basic " + TOKEN.encode(), TOKEN.encode()]:
        with pytest.raises(InvalidTokenError):
            access.check(_scope(("127.0.0.1", 1), authorization))
        with pytest.raises(InvalidTokenError):
            access.check(_scope(("192.0.2.7", 1), authorization))


# The endpoint in a real app ------------------------------------------------------------------


async def test_a_non_loopback_client_is_refused_with_the_json_error_body():
    app = counter_app()
    refused = await asgi_get(app, "/metrics", client=("192.0.2.7", 40000))
    assert refused.status == 403
    assert refused.headers[b"content-type"] == b"application/json"
    assert refused.json()["error"]["code"] == "forbidden"
    answered = await asgi_get(app, "/metrics")
    assert answered.status == 200
    assert answered.headers[b"content-type"].decode() == CONTENT_TYPE
    # The refusal counts as a request like any other.
    assert values(answered.body, "gym_sessions_requests_total") == {
        (("route", "/metrics"), ("status", "403")): 1
    }


async def test_a_token_app_answers_the_token_only_with_a_challenge_otherwise():
    app = counter_app(metrics_token=TOKEN)
    refused = await asgi_get(app, "/metrics")
    assert refused.status == 401
    assert refused.json()["error"]["code"] == "invalid_token"
    assert refused.headers[b"www-authenticate"].startswith(b"Bearer")
    bearer = [(b"authorization", b"Bearer " + TOKEN.encode())]
    remote = await asgi_get(app, "/metrics", client=("192.0.2.7", 1), headers=bearer)
    assert remote.status == 200


async def test_only_get_reads_the_page_and_metrics_off_removes_it():
    app = counter_app()
    posted = await asgi_get(app, "/metrics", method="POST")  # the server's routes: none here
    assert posted.status == 404
    assert posted.json()["error"]["code"] == "not_found"
    off = counter_app(metrics=False)
    assert off.metrics is None
    gone = await asgi_get(off, "/metrics")
    assert gone.status == 404
    assert gone.json()["error"]["code"] == "not_found"


async def test_tool_calls_are_timed_on_the_worker_that_runs_them():
    app = counter_app()
    reset = await asgi_get(app, "/reset", method="POST", body=b"{}")
    assert reset.status == 200
    cookie = reset.headers[b"set-cookie"].split(b";")[0]
    for _ in range(3):
        step = await asgi_get(
            app, "/step", headers=[(b"cookie", cookie)], method="POST", body=b'{"action": 1}'
        )
        assert step.status == 200
    page = (await asgi_get(app, "/metrics")).body
    (count,) = [
        v
        for k, v in values(page, "gym_sessions_tool_call_seconds_count").items()
        if dict(k)["tool"] == "step"
    ]
    assert count == 3
    assert values(page, "gym_sessions_open_sessions") == {(("worker", app.worker_id),): 1}


# The status table ----------------------------------------------------------------------------

PAGE = """\
# TYPE gym_sessions_worker_info gauge
gym_sessions_worker_info{pid="20",worker="20-b"} 1.0
gym_sessions_worker_info{pid="10",worker="10-a"} 1.0
# TYPE gym_sessions_open_sessions gauge
gym_sessions_open_sessions{worker="10-a"} 3.0
gym_sessions_open_sessions{worker="20-b"} 1.0
# TYPE gym_sessions_claims gauge
gym_sessions_claims{worker="10-a"} 7.0
gym_sessions_claims{worker="20-b"} 2.0
# TYPE gym_sessions_worker_requests_total counter
gym_sessions_worker_requests_total{served="local",worker="10-a"} 40.0
gym_sessions_worker_requests_total{served="forwarded",worker="10-a"} 10.0
gym_sessions_worker_requests_total{served="local",worker="20-b"} 5.0
gym_sessions_worker_requests_total{served="forwarded",worker="20-b"} 15.0
gym_sessions_worker_requests_total{served="local",worker="9-gone"} 8.0
gym_sessions_worker_requests_total{served="forwarded",worker="9-gone"} 2.0
# TYPE gym_sessions_session_refusals_total counter
gym_sessions_session_refusals_total{status="409",worker="10-a"} 2.0
gym_sessions_session_refusals_total{status="410",worker="20-b"} 4.0
# TYPE gym_sessions_tool_call_seconds histogram
gym_sessions_tool_call_seconds_bucket{le="0.001",tool="step",via="http",worker="10-a"} 0.0
gym_sessions_tool_call_seconds_bucket{le="0.002",tool="step",via="http",worker="10-a"} 4.0
gym_sessions_tool_call_seconds_bucket{le="+Inf",tool="step",via="http",worker="10-a"} 4.0
gym_sessions_tool_call_seconds_bucket{le="0.001",tool="step",via="mcp",worker="10-a"} 0.0
gym_sessions_tool_call_seconds_bucket{le="0.002",tool="step",via="mcp",worker="10-a"} 0.0
gym_sessions_tool_call_seconds_bucket{le="+Inf",tool="step",via="mcp",worker="10-a"} 4.0
gym_sessions_tool_call_seconds_count{tool="step",via="http",worker="10-a"} 4.0
gym_sessions_tool_call_seconds_sum{tool="step",via="http",worker="10-a"} 0.006
gym_sessions_tool_call_seconds_count{tool="step",via="mcp",worker="10-a"} 4.0
gym_sessions_tool_call_seconds_sum{tool="step",via="mcp",worker="10-a"} 0.1
"""


def test_status_table_rows_exited_workers_and_totals():
    table = status_table(parse_samples(PAGE))
    assert [row.worker for row in table.live] == ["10-a", "20-b"]  # by pid
    a, b = table.live
    assert (a.pid, a.open_sessions, a.claims, a.requests, a.forwarded) == ("10", 3, 7, 50, 10)
    assert (a.conflicts, a.gone, b.conflicts, b.gone) == (2, 0, 0, 4)
    # http and mcp together: 4 in (0.001, 0.002], 4 above; the median is the 0.002 bound.
    assert a.step_p50 == pytest.approx(0.002)
    assert b.step_p50 is None
    assert table.exited is not None and table.exited_count == 1
    assert (table.exited.requests, table.exited.open_sessions) == (10, None)
    totals = table.totals
    assert (totals.open_sessions, totals.claims, totals.requests, totals.forwarded) == (
        4,
        9,
        80,
        27,
    )
    assert (totals.conflicts, totals.gone) == (2, 4)
    lines = table.render().splitlines()
    assert lines[0].split() == [
        "worker", "pid", "open", "claims", "requests", "forwarded", "409", "410", "step", "p50",
    ]  # fmt: skip
    assert lines[1].split() == ["10-a", "10", "3", "7", "50", "10", "2", "0", "2.00", "ms"]
    assert lines[3].split() == ["(exited:", "1)", "-", "-", "10", "2", "0", "0", "-"]
    assert lines[4].split() == ["total", "4", "9", "80", "27", "2", "4", "2.00", "ms"]


# The shared directory ------------------------------------------------------------------------


def test_only_gone_processes_lose_their_live_gauges(tmp_path):
    import os

    from gym_sessions.metrics import MetricsDirectory

    directory = MetricsDirectory(str(tmp_path))
    gone_pid = 4_194_305  # above the largest pid_max Linux allows: never a process
    names = [
        f"gauge_livesum_{os.getpid()}.db",
        f"gauge_liveall_{gone_pid}.db",
        f"gauge_livesum_{gone_pid}.db",
        f"counter_{gone_pid}.db",
        f"histogram_{gone_pid}.db",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert directory.forget_exited_workers() == [gone_pid]
    # A gone worker's counts stay in the totals; only its live gauges go.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names[0], f"counter_{gone_pid}.db", f"histogram_{gone_pid}.db"]
    )


def test_exactly_one_authorization_header_is_taken_several_are_refused():
    access = MetricsAccess(TOKEN)
    right = (b"authorization", b"Bearer " + TOKEN.encode())
    wrong = (b"authorization", b"Bearer wrong")
    for headers in ([wrong, right], [right, right], [right, wrong]):
        with pytest.raises(InvalidRequestError) as refused:
            access.check({"client": ("127.0.0.1", 1), "headers": headers})
        assert refused.value.status == 400
    access.check({"client": ("127.0.0.1", 1), "headers": [right]})


def test_a_symlinked_token_file_is_refused_as_a_symlinked_secret_file(tmp_path):
    real = tmp_path / "token"
    real.write_text(TOKEN + "\n")
    real.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert read_secret_file(str(real), "metrics token") == TOKEN
    for kind in ("metrics token", "secret"):
        with pytest.raises(StartupError, match="symbolic link"):
            read_secret_file(str(link), kind)
