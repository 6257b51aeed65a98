"""`JSONReply`: Starlette's ``JSONResponse`` with its encoder made once.

``JSONResponse.render`` calls ``json.dumps`` with options, which builds a new
``JSONEncoder`` for every reply; this class encodes the same bytes (compact,
UTF-8, NaN and Infinity refused) with one encoder made at import.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["JSONReply"]

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class JSONReply(JSONResponse):
    """A JSON reply, byte for byte as ``JSONResponse`` renders it."""

    def render(self, content: Any) -> bytes:
        return _ENCODER.encode(content).encode("utf-8")
