"""The wire format of rendered frames (``POST /render``), shared by server and client.

A frame travels as raw bytes, never as JSON lists of numbers:

============================  ======  ============================  =========================
``env.render()`` returned     status  content type                  headers
============================  ======  ============================  =========================
a numpy array                 200     ``application/octet-stream``  dtype, shape
a sequence of equal arrays    200     ``application/octet-stream``  dtype, shape, list
a string (``ansi``)           200     ``text/plain; charset=utf-8``
``None`` (``human``)          204
============================  ======  ============================  =========================

The dtype header holds numpy's ``dtype.str`` (byte order included, e.g.
``|u1``), the shape header the comma-separated axis lengths (empty for a
scalar). A sequence of frames (an ``*_list`` mode) is stacked on a new first
axis and marked by the list header, so it comes back as a list of arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FRAME_DTYPE_HEADER",
    "FRAME_LIST_HEADER",
    "FRAME_SHAPE_HEADER",
    "EncodedFrame",
    "decode_frame",
    "encode_frame",
]

FRAME_DTYPE_HEADER = "x-gym-frame-dtype"
FRAME_SHAPE_HEADER = "x-gym-frame-shape"
FRAME_LIST_HEADER = "x-gym-frame-list"
_ARRAY_TYPE = "application/octet-stream"
_TEXT_TYPE = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class EncodedFrame:
    """A frame ready to send: status, content type, extra headers and body."""

    status: int
    media_type: str | None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def _array_frame(array: np.ndarray, *, is_list: bool = False) -> EncodedFrame:
    if array.dtype.hasobject or array.dtype.fields is not None:
        raise TypeError(f"cannot send a frame of dtype {array.dtype}")
    headers = {
        FRAME_DTYPE_HEADER: array.dtype.str,
        FRAME_SHAPE_HEADER: ",".join(str(n) for n in array.shape),
    }
    if is_list:
        headers[FRAME_LIST_HEADER] = "1"
    return EncodedFrame(200, _ARRAY_TYPE, np.ascontiguousarray(array).tobytes(), headers)


def encode_frame(frame: Any) -> EncodedFrame:
    """``frame`` (what ``env.render()`` returned) as a reply.

    Raises:
        TypeError: the frame is of a kind this format cannot carry.
    """
    if frame is None:
        return EncodedFrame(204, None)
    if isinstance(frame, str):
        return EncodedFrame(200, _TEXT_TYPE, frame.encode())
    if isinstance(frame, np.ndarray | np.generic):
        return _array_frame(np.asarray(frame))
    if isinstance(frame, Sequence) and all(isinstance(f, np.ndarray) for f in frame):
        if len({(f.shape, f.dtype) for f in frame}) > 1:
            raise TypeError("cannot send a list of frames of different shapes or dtypes")
        stacked = np.stack(frame) if frame else np.zeros((0,), np.uint8)
        return _array_frame(stacked, is_list=True)
    raise TypeError(f"cannot send a frame of type {type(frame).__name__}")


def decode_frame(status: int, headers: Mapping[str, str], body: bytes) -> Any:
    """The frame a ``/render`` reply carries (``headers`` with lower-case names).

    Raises:
        ValueError: the reply is not a frame in this format.
    """
    if status == 204:
        return None
    content_type = headers.get("content-type", "").split(";", 1)[0].strip()
    if content_type == "text/plain":
        return body.decode()
    if content_type != _ARRAY_TYPE:
        raise ValueError(f"a /render reply of content type {content_type!r} is not a frame")
    try:
        dtype = np.dtype(headers[FRAME_DTYPE_HEADER])
        shape_text = headers[FRAME_SHAPE_HEADER]
        shape = tuple(int(n) for n in shape_text.split(",")) if shape_text else ()
        array = np.frombuffer(body, dtype=dtype).reshape(shape).copy()
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed frame reply: {exc}") from exc
    if headers.get(FRAME_LIST_HEADER) == "1":
        if array.ndim == 0:
            raise ValueError("malformed frame reply: a list of frames needs a leading axis")
        return list(array)
    return array
