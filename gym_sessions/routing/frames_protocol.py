"""The wire format of the ``frames`` hop: an ASGI request and its reply as length-prefixed frames.

Both ends of the hop use this module: `FrameForwarder` on the worker that
accepted the request, `FrameListener` on the claimant. Every frame is a 9-byte
header, its kind (1 byte) and its payload length (8 bytes, big-endian), then
the payload:

=========  ==========  =========================================================
direction  kind        payload
=========  ==========  =========================================================
request    ``HEAD``    the request's scope fields and headers (`encode_head`)
request    ``BODY``    the whole request body
reply      ``START``   the status and headers (`encode_start`)
reply      ``CHUNK``   part of the reply body; more follows
reply      ``END``     the last part of the reply body (possibly empty)
=========  ==========  =========================================================

A field list (``HEAD``, ``START``) is its count and each field's length (4
bytes each, big-endian), then the fields. Strings travel as UTF-8, headers as
the raw bytes ASGI gives them. Nothing here evaluates what it decodes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

from starlette.types import Scope

from gym_sessions.routing.runtime_dir import RuntimeDirectory

__all__ = [
    "BODY",
    "CHUNK",
    "END",
    "HEAD",
    "START",
    "FrameError",
    "FrameReader",
    "decode_head",
    "decode_start",
    "encode_head",
    "encode_start",
    "frame",
    "frame_header",
    "frame_socket_path",
]

HEAD, BODY, START, CHUNK, END = 1, 2, 3, 4, 5

_HEADER = struct.Struct("!BQ")
_COUNT = struct.Struct("!I")
_HEAD_FIELDS = 9  # before the headers, see encode_head


class FrameError(Exception):
    """The peer sent something that is not a frame this hop expects."""


def frame_socket_path(runtime_dir: RuntimeDirectory, worker_id: str) -> str:
    """The frames socket of ``worker_id``.

    ``<id>.asgi`` beside the HTTP ``<id>.sock``: a name of the same length, so
    it fits the socket-path budget the runtime directory was chosen for.
    """
    return os.path.join(runtime_dir.workers_dir, f"{worker_id}.asgi")


def frame_header(kind: int, length: int) -> bytes:
    """The header of a frame whose payload (``length`` bytes) is written separately."""
    return _HEADER.pack(kind, length)


def frame(kind: int, payload: bytes) -> bytes:
    """One whole frame."""
    return _HEADER.pack(kind, len(payload)) + payload


def _pack_fields(fields: list[bytes]) -> bytes:
    count = len(fields)
    return struct.pack(f"!{count + 1}I", count, *map(len, fields)) + b"".join(fields)


def _unpack_fields(payload: bytes) -> list[bytes]:
    try:
        (count,) = _COUNT.unpack_from(payload)
        lengths = struct.unpack_from(f"!{count}I", payload, _COUNT.size)
    except struct.error as exc:
        raise FrameError(f"truncated field list: {exc}") from None
    offset = _COUNT.size * (count + 1)
    if offset + sum(lengths) != len(payload):
        raise FrameError("field lengths do not add up to the payload")
    fields = []
    for length in lengths:
        fields.append(payload[offset : offset + length])
        offset += length
    return fields


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _str(value: bytes) -> str:
    return value.decode("utf-8", "surrogatepass")


def _encode_address(address: Iterable[object] | None) -> bytes:
    if address is None:
        return b""
    host, port = address
    return _text(str(host)) + b"\x00" + (b"" if port is None else str(port).encode())


def _decode_address(value: bytes) -> tuple[str, int | None] | None:
    if not value:
        return None
    host, _, port = value.rpartition(b"\x00")
    return _str(host), int(port) if port else None


def encode_head(scope: Scope, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The ``HEAD`` payload: the fields of an http ``scope`` the claimant needs, and ``headers``."""
    fields = [
        scope["method"].encode("ascii"),
        scope.get("scheme", "http").encode("ascii"),
        scope.get("http_version", "1.1").encode("ascii"),
        _text(scope["path"]),
        scope.get("raw_path") or _text(scope["path"]),
        scope.get("query_string", b""),
        _text(scope.get("root_path", "")),
        _encode_address(scope.get("client")),
        _encode_address(scope.get("server")),
    ]
    for name, value in headers:
        fields += (name, value)
    return _pack_fields(fields)


def decode_head(payload: bytes) -> Scope:
    """An ASGI http scope from a ``HEAD`` payload (without the private-socket mark)."""
    fields = _unpack_fields(payload)
    if len(fields) < _HEAD_FIELDS or (len(fields) - _HEAD_FIELDS) % 2:
        raise FrameError(f"a request head has {len(fields)} fields")
    method, scheme, http_version, path, raw_path, query, root_path, client, server = fields[
        :_HEAD_FIELDS
    ]
    rest = fields[_HEAD_FIELDS:]
    try:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": http_version.decode("ascii"),
            "method": method.decode("ascii"),
            "scheme": scheme.decode("ascii"),
            "path": _str(path),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": _str(root_path),
            "headers": list(zip(rest[::2], rest[1::2], strict=True)),
            "client": _decode_address(client),
            "server": _decode_address(server),
            "state": {},
        }
    except ValueError as exc:  # UnicodeDecodeError included
        raise FrameError(f"bad request head: {exc}") from None


def encode_start(status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The ``START`` payload of a reply."""
    fields = [str(status).encode("ascii")]
    for name, value in headers:
        fields += (name, value)
    return _pack_fields(fields)


def decode_start(payload: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """Status and headers from a ``START`` payload."""
    fields = _unpack_fields(payload)
    if not fields or len(fields) % 2 != 1 or not fields[0].isdigit():
        raise FrameError("bad reply start")
    rest = fields[1:]
    return int(fields[0]), list(zip(rest[::2], rest[1::2], strict=True))


class FrameReader:
    """Splits a byte stream into ``(kind, payload)`` frames as its bytes arrive.

    Args:
        max_payload: A longer payload is a `FrameError` (the peer is not our hop).
    """

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Take ``data``; return the frames it completed, in order."""
        buffer = self._buffer
        buffer += data
        size = len(buffer)
        frames: list[tuple[int, bytes]] = []
        offset = 0
        while size - offset >= _HEADER.size:
            kind, length = _HEADER.unpack_from(buffer, offset)
            if length > self.max_payload or not HEAD <= kind <= END:
                raise FrameError(f"frame of kind {kind} with {length} bytes")
            start = offset + _HEADER.size
            end = start + length
            if end > size:
                break
            with memoryview(buffer) as view:
                frames.append((kind, view[start:end].tobytes()))
            offset = end
        if offset:
            del buffer[:offset]
        return frames
