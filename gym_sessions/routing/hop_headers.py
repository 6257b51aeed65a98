"""The headers of the hop (§3.10.2): what a forward drops, signs and marks.

Which request headers travel to the holder (`forwarded_headers`: no hop-by-hop
ones, no ``content-length``, no ``expect``, no mark or signature a client
sent), which reply headers come back (`reply_headers`), and the marks the
forwarding worker adds (`PLACED_MARK`, `HELD_MARK`). The forwarder, the
forward signature and connection handoff's replay all rebuild a request from
these, so they never disagree about what a hop passes on.
"""

from __future__ import annotations

from starlette.types import Scope

__all__ = [
    "HELD_MARK",
    "HOP_BY_HOP_HEADERS",
    "HOP_MARKS_KEY",
    "NOT_HELD_HEADER",
    "PLACED_MARK",
    "SIGNATURE_HEADER",
    "forwarded_headers",
    "hop_marks",
    "received_mark",
    "received_marks",
    "reply_headers",
    "request_target",
]

HOP_BY_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# The body travels whole, so its length is set anew, the accepting worker
# already answered any ``Expect: 100-continue``, and only the forwarding worker
# may sign a request for a private listener.
SIGNATURE_HEADER = b"x-gym-forward-signature"
# Hop marks: what the forwarding worker tells the receiving one about this hop
# (the router sets them in the scope under `HOP_MARKS_KEY`; they travel after
# the request's own headers and, on TCP, under the signature). A client's own
# header of such a name never passes a hop, so only a peer worker sets one.
#: ``<load>``: a start placed here because the sender saw this worker at
#: ``<load>`` sessions; refuse it (no-room mark) if this worker holds clearly more.
PLACED_MARK = b"x-gym-hop-placed"
#: ``1``: sent on a cached holder lookup; refuse (`NOT_HELD_HEADER`) unless this
#: worker holds the session, never claim or serve it.
HELD_MARK = b"x-gym-hop-held"
_MARKS = frozenset({PLACED_MARK, HELD_MARK})
#: On a private reply: this worker does not hold the session a `HELD_MARK` named.
NOT_HELD_HEADER = b"x-gym-not-held"
HOP_MARKS_KEY = "gym_sessions.hop_marks"
_NOT_FORWARDED = HOP_BY_HOP_HEADERS | _MARKS | {b"content-length", b"expect", SIGNATURE_HEADER}


def request_target(scope: Scope) -> bytes:
    """The request's target as it arrived: raw path and query string."""
    target = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    return target + b"?" + query if query else target


def forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers without hop-by-hop ones and without its length."""
    return [(name, value) for name, value in scope["headers"] if name not in _NOT_FORWARDED]


def hop_marks(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The marks the forwarding worker sends with this hop (set in ``scope[HOP_MARKS_KEY]``)."""
    return list(scope.get(HOP_MARKS_KEY, ()))


def received_marks(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The hop marks a request that arrived over a private listener carries."""
    return [(name, value) for name, value in scope["headers"] if name in _MARKS]


def received_mark(scope: Scope, name: bytes) -> bytes | None:
    """The value of hop mark ``name`` on a request that arrived privately, or ``None``."""
    for header, value in scope["headers"]:
        if header == name:
            return value
    return None


def reply_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A holder's reply headers, lower-cased, without hop-by-hop ones."""
    lowered = ((name.lower(), value) for name, value in raw)
    return [(name, value) for name, value in lowered if name not in HOP_BY_HOP_HEADERS]
