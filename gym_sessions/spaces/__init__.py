"""Gymnasium spaces and their values as JSON: the wire format's one owner.

Nothing else in gym-sessions knows how a space is described in JSON or how an
observation or action is written to and read from JSON. One module per concern:

- `gym_sessions.spaces.descriptions`: a space <-> its JSON description
  (`space_to_json`, `space_from_json`; ``GET /spaces``);
- `gym_sessions.spaces.values`: a value of a space <-> JSON
  (`value_to_json`, `value_from_json`; observations and actions);
- `gym_sessions.spaces.json_schema`: a JSON Schema for a space's values
  (`space_json_schema`; tool parameters).

Numbers travel exactly, non-finite floats as the strings ``"inf"``, ``"-inf"``
and ``"nan"``. Everything invalid coming in raises `SpaceCodecError`, a `ValueError`.
"""

from gym_sessions.spaces._codec import SpaceCodecError
from gym_sessions.spaces.descriptions import space_from_json, space_to_json
from gym_sessions.spaces.json_schema import space_json_schema
from gym_sessions.spaces.values import value_from_json, value_to_json

__all__ = [
    "SpaceCodecError",
    "space_from_json",
    "space_json_schema",
    "space_to_json",
    "value_from_json",
    "value_to_json",
]
