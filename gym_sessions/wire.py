"""Names of the wire contract that server and client both spell (``docs/design.md`` §3.2, §3.11).

Kept here, in a module that imports nothing, so the client never imports the
server to learn them and neither side can drift from the other.
"""

__all__ = ["CLOSE_FOLLOWS_HEADER", "SESSION_COOKIE"]

#: The session cookie's default name (``Settings.session_cookie`` may rename it).
SESSION_COOKIE = "gym_session"

#: On ``/verify``: a ``/close_session`` follows, so the session stays open for it.
CLOSE_FOLLOWS_HEADER = "x-gym-close-follows"
