"""zstd for binary value replies on links that are not loopback (docs/design.md §3.15).

A client that can decode zstd and talks to a host other than loopback asks
for it (``Accept-Encoding: zstd``); the worker that answers the client then
compresses a binary values reply of at least `MIN_SIZE` bytes, at `LEVEL`,
when that makes it smaller (``Content-Encoding: zstd``). JSON replies never
change: curl, MCP and LLM tool calls see exactly the JSON of §3.2. On
loopback the copy is cheaper than the compression, so clients do not ask.

zstd comes from the standard library's ``compression.zstd`` (Python >= 3.14)
or its backport, ``backports.zstd`` (a dependency below 3.14); without
either, nothing is compressed and nothing is asked for.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import sys
from typing import Any


def _zstd_module() -> Any:
    """The standard library's zstd (Python >= 3.14), else its backport, else ``None``.

    Below 3.14 there is no standard ``compression`` package, so that name is
    never looked up there: it would find whatever a user's ``compression.py``
    on the path is, and run it.
    """
    if sys.version_info >= (3, 14):
        names: tuple[str, ...] = ("compression.zstd", "backports.zstd")
    else:
        names = ("backports.zstd",)
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


_zstd: Any = _zstd_module()

__all__ = [
    "ENCODING",
    "LEVEL",
    "MIN_SIZE",
    "accepts_zstd",
    "available",
    "compress",
    "decompress",
    "is_loopback",
]

#: The ``Content-Encoding`` (and ``Accept-Encoding`` token) of a compressed reply.
ENCODING = "zstd"
#: zstd's fastest level but one: an Atari frame in tens of microseconds.
LEVEL = 1
#: Smaller replies are sent as they are: a few packets either way.
MIN_SIZE = 16 * 1024


def available() -> bool:
    """Whether this interpreter can compress and decompress zstd."""
    return _zstd is not None


def compress(data: bytes) -> bytes:
    """``data`` as one zstd frame, at `LEVEL`."""
    assert _zstd is not None, "check available() first"
    return _zstd.compress(data, LEVEL)


def decompress(data: bytes, limit: int) -> bytes:
    """The bytes a zstd reply holds, at most ``limit`` of them.

    Raises:
        ValueError: ``data`` is not zstd, is truncated, or holds more than
            ``limit`` bytes (a small reply must not grow without bound).
    """
    assert _zstd is not None, "check available() first"
    decompressor = _zstd.ZstdDecompressor()
    try:
        out = decompressor.decompress(data, max_length=limit)
    except _zstd.ZstdError as exc:
        raise ValueError(f"the reply is not valid zstd: {exc}") from exc
    if not decompressor.eof:
        if decompressor.needs_input:
            raise ValueError("the zstd reply is truncated")
        raise ValueError(f"the zstd reply holds more than {limit} bytes")
    if decompressor.unused_data:
        raise ValueError("bytes after the zstd reply")
    return out


@functools.lru_cache(maxsize=64)  # a client sends the same value again and again
def accepts_zstd(accept_encoding: str | bytes | None) -> bool:
    """Whether an ``Accept-Encoding`` lists ``zstd`` with a q-value above 0."""
    if accept_encoding is None:
        return False
    text = (
        accept_encoding.decode("latin-1") if isinstance(accept_encoding, bytes) else accept_encoding
    )
    for item in text.lower().split(","):
        token, *params = (part.strip() for part in item.split(";"))
        if token != ENCODING:
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def is_loopback(host: Any) -> bool:
    """Whether ``host`` (a URL's host name or address) is this machine's loopback."""
    name = str(host).strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
