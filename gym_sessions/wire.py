"""Names of the wire contract that server and client both spell (``docs/design.md`` §3.2, §3.11).

Kept here, in a module that imports nothing, so the client never imports the
server to learn them and neither side can drift from the other.
"""

import re

__all__ = [
    "CLOSE_FOLLOWS_HEADER",
    "DEBUG_WORKER_HEADER",
    "EPISODE_LENGTH_HEADER",
    "HOLDER_HEADER",
    "PYTHON_INT_FIELD",
    "RELAYED_BY_HEADER",
    "SESSION_COOKIE",
    "SESSION_GONE_CLOSE_CODE",
    "START_BESIDE_HEADER",
    "VALUES_SUBPROTOCOL",
    "WEBSOCKET_PATH",
    "WS_ENVELOPE_BYTES",
    "route_path",
]

#: The session cookie's default name (``Settings.session_cookie`` may rename it).
SESSION_COOKIE = "gym_session"

#: On ``/verify``: a ``/close_session`` follows, so the session stays open for it.
CLOSE_FOLLOWS_HEADER = "x-gym-close-follows"

#: On a session start: the cookie value of another session of this client; with
#: balanced placement the new session starts on that session's worker if it has
#: room (a vector env's group shares a worker, so one step batch steps it).
START_BESIDE_HEADER = "x-gym-start-beside"

#: On every reply of a server started with ``--debug-worker-header``: the id of
#: the worker that served the request (the session's holder).
DEBUG_WORKER_HEADER = "x-gym-worker"

#: On every reply a worker's app produced on a server that routes sessions (not
#: only with the debug header): that worker's id, the session's holder. A hint
#: for clients that pool connections (`ConnectionPool`), never a credential:
#: the request still carries its cookie or key and is routed by it.
HOLDER_HEADER = "x-gym-holder"

#: Added by the worker that received a request and relayed it to its holder:
#: that worker's id. The connection stays with it, so a pooled client counts
#: the connection as that worker's and the session as the holder's.
RELAYED_BY_HEADER = "x-gym-relayed-by"

#: On ``/step``: the episode's length before this step, as the client counts it.
#: The step runs only if the server counts the same (else 409 ``step_out_of_order``,
#: nothing changed): a send delayed in a hop that died, arriving after the client
#: recovered its lost reply, can never run the step a second time.
EPISODE_LENGTH_HEADER = "x-gym-episode-length"

#: In a ``/reset``, ``/seed_session`` or ``/step`` reply (and a step batch result):
#: ``true`` when the served env returned its Discrete observation as a Python
#: ``int``, which the client then gives back instead of a numpy integer.
PYTHON_INT_FIELD = "observation_python_int"

#: The WebSocket endpoint: one connection carries one client's session requests.
WEBSOCKET_PATH = "/ws"

#: The /ws subprotocol of a connection whose messages may also be binary frames:
#: a request or reply whose body is a binary values message (§3.15, §3.16).
VALUES_SUBPROTOCOL = "gym-sessions.values.v1"

#: What a /ws message may add to its body's bytes (``max_body_bytes``) for its envelope.
WS_ENVELOPE_BYTES = 64 * 1024

#: The close code of a WebSocket whose session is gone (410's meaning): its holder
#: exited, or the server closed it for idling. Reconnecting cannot reach it.
SESSION_GONE_CLOSE_CODE = 4410

#: Every route is served bare and under this prefix (``/rollouts/{rollout_id}/reset``).
_ROLLOUT_PREFIX = re.compile(r"/rollouts/[^/]+(?=/)")


def route_path(path: str) -> str:
    """``path`` without its ``/rollouts/{rollout_id}`` prefix."""
    match = _ROLLOUT_PREFIX.match(path)
    return path[match.end() :] if match else path
