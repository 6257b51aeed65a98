"""Rollout records to and from files (JSONL, or binary for large arrays), and into DataFrames.

A record is one dict: a step of `run_episodes` (``episode``, ``step``,
``env_index``, ``worker``, ``observation``, ``action``, ``reward``,
``terminated``, ``truncated``) or the reply of an agent's ``POST /run``
(``reward``, ``episode_return``, ``episode_length``, ``env_session_id``,
``verify``). A file holds one JSON object per line; the first line is a header
naming the format and, when known, the observation and action spaces (as
``GET /spaces`` describes them)::

    {"format": "gym-sessions/records", "version": 1,
     "observation_space": {...}, "action_space": {...}}
    {"episode": 0, "step": 0, "env_index": 0, "worker": "4242-1a2b",
     "observation": [0.01, ...], ...}

(one line each in the file).

Values are made JSON-safe exactly as the wire does (`gym_sessions.spaces`):
``observation`` and ``action`` through their spaces (`value_to_json`), so they
load back with their dtypes, shapes and non-finite floats; every other field as
info dicts travel (`to_jsonable`: numpy scalars to Python, arrays to lists,
non-finite floats to ``"inf"``/``"-inf"``/``"nan"``), and the real-valued
``reward`` and ``episode_return`` load back as floats, non-finite ones included.

For image observations a JSON list per frame costs several times the frame's
bytes and much more time; `save_binary` writes the same records with every
array as its raw bytes instead, in §3.15's frames (docs/design.md): an
8-byte magic, then frames, each preceded by its length as a little-endian
unsigned 64-bit integer and padded with zero bytes to a multiple of 8 (so
each blob stays 8-aligned in the file)::

    b"GSREC\x00\x00\x01"
    <u64 length> <frame: head = the JSONL header plus "encoding": "binary">
    <u64 length> <frame: head = one record, each observation or action
                  {"tree": T, "buffers": [0, 1, ...]} as in value messages,
                  blobs = that record's arrays>
    ...

`load_binary` reads the file once and gives arrays that are views of that one
buffer (writable), bit-exact for every space of the codec.

pandas is imported only by `to_dataframe` (``pip install 'gym-sessions[pandas]'``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gymnasium.spaces import Space

from gym_sessions.spaces import space_from_json, space_to_json, value_from_json, value_to_json
from gym_sessions.spaces._arrays import NONFINITE
from gym_sessions.spaces.binary import Buffer, frame, unframe, value_from_tree, value_to_tree
from gym_sessions.spaces.values import to_jsonable
from gym_sessions.strict_json import loads

if TYPE_CHECKING:
    import pandas

__all__ = [
    "RECORDS_FORMAT",
    "RolloutRecords",
    "load_binary",
    "load_jsonl",
    "save_binary",
    "save_jsonl",
    "to_dataframe",
]

#: The header's ``format``; a file whose first line lacks it holds records only.
RECORDS_FORMAT = "gym-sessions/records"
RECORDS_VERSION = 1

#: Fields written through a space when one is known.
_SPACE_FIELDS = ("observation", "action")
#: Real-valued fields whose non-finite strings load back as floats.
_REAL_FIELDS = frozenset({"reward", "episode_return"})

PathLike = str | os.PathLike[str]

#: The first bytes of a `save_binary` file.
BINARY_MAGIC = b"GSREC\x00\x00\x01"
_LENGTH = struct.Struct("<Q")


class RolloutRecords(list[dict[str, Any]]):
    """A list of records that knows the spaces of its observations and actions.

    `run_episodes` returns one; `load_jsonl` too. It is a plain list otherwise
    (``records == [...]``, slicing and list comprehensions give plain lists, so
    pass the spaces to `save_jsonl` for a filtered list).

    Example:
        >>> records = run_episodes(url, lambda obs: int(obs[2] > 0), episodes=10)
        >>> records.save_jsonl("cartpole.jsonl")
        >>> again = RolloutRecords.load_jsonl("cartpole.jsonl")
        >>> again.to_dataframe().groupby("episode")["reward"].sum()

    Args:
        records: The records.
        observation_space: The space of every record's ``observation``, if any.
        action_space: The space of every record's ``action``, if any.
    """

    def __init__(
        self,
        records: Iterable[dict[str, Any]] = (),
        *,
        observation_space: Space[Any] | None = None,
        action_space: Space[Any] | None = None,
    ) -> None:
        super().__init__(records)
        self.observation_space = observation_space
        self.action_space = action_space

    def save_jsonl(self, path: PathLike) -> None:
        """Write these records to ``path`` (see `save_jsonl`)."""
        save_jsonl(self, path)

    def save_binary(self, path: PathLike) -> None:
        """Write these records to ``path``, arrays as raw bytes (see `save_binary`)."""
        save_binary(self, path)

    @classmethod
    def load_binary(cls, path: PathLike) -> RolloutRecords:
        """Read records written by `save_binary` (see `load_binary`)."""
        return load_binary(path)

    @classmethod
    def load_jsonl(cls, path: PathLike) -> RolloutRecords:
        """Read records written by `save_jsonl` (see `load_jsonl`)."""
        return load_jsonl(path)

    def to_dataframe(self) -> pandas.DataFrame:
        """These records as a DataFrame (see `to_dataframe`)."""
        return to_dataframe(self)


def _spaces_of(
    records: Iterable[Mapping[str, Any]],
    observation_space: Space[Any] | None,
    action_space: Space[Any] | None,
) -> dict[str, Space[Any] | None]:
    # `is None`, not `or`: an empty Dict or Tuple space is falsy (it has a length).
    if observation_space is None:
        observation_space = getattr(records, "observation_space", None)
    if action_space is None:
        action_space = getattr(records, "action_space", None)
    return {"observation": observation_space, "action": action_space}


def _is_plain_json(value: Any) -> bool:
    """Whether ``value`` is JSON data as it is (so it loads back unchanged without a space)."""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in value.items())
    return False


def _encode_record(
    record: Mapping[str, Any],
    spaces: Mapping[str, Space[Any] | None],
    line: int,
    encode: Callable[[Space[Any], Any], Any] = value_to_json,
) -> dict[str, Any]:
    """A record as JSON data: its space fields through ``encode``, the rest as info dicts."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        space = spaces.get(key)
        if space is not None:
            out[key] = encode(space, value)
        elif key in _SPACE_FIELDS and not _is_plain_json(value):
            # to_jsonable would write it, but it would load back as lists, not as
            # the arrays (with their dtypes) that were saved.
            raise ValueError(
                f"record {line}: its {key!r} is {type(value).__name__}, which needs its "
                f"space to be saved exactly: pass {key}_space= (the env's "
                f"single_{key}_space), or save the records run_episodes returned"
            )
        else:
            out[key] = to_jsonable(value)
    return out


def save_jsonl(
    records: Iterable[Mapping[str, Any]],
    path: PathLike,
    *,
    observation_space: Space[Any] | None = None,
    action_space: Space[Any] | None = None,
) -> None:
    """Write records to a JSONL file: a header line, then one record per line.

    Example:
        >>> records = run_episodes(url, policy, episodes=20, num_envs=4)
        >>> save_jsonl(records, "rollouts.jsonl")
        >>> save_jsonl([r for r in records if r["episode"] < 5], "first.jsonl",
        ...            observation_space=records.observation_space,
        ...            action_space=records.action_space)

    Args:
        records: Dicts, e.g. what `run_episodes` returns or ``/run`` replies.
        path: The file to write (replaced if it exists).
        observation_space: The space of ``observation`` values; by default the
            records' own (`RolloutRecords`), if any.
        action_space: The same for ``action`` values.

    Raises:
        ValueError: An ``observation`` or ``action`` holds numpy data but no
            space is known for it.
        SpaceCodecError: A value does not fit its space.
    """
    spaces = _spaces_of(records, observation_space, action_space)
    header = _header(spaces)
    # Encode everything before opening the file, so a bad record leaves no half file.
    lines = [header] + [
        _encode_record(record, spaces, number) for number, record in enumerate(records)
    ]
    with open(path, "w", encoding="utf-8") as file:
        for data in lines:
            file.write(json.dumps(data, allow_nan=False, separators=(",", ":")) + "\n")


def _header(spaces: Mapping[str, Space[Any] | None], **extra: Any) -> dict[str, Any]:
    return {
        "format": RECORDS_FORMAT,
        "version": RECORDS_VERSION,
        **extra,
        **{
            f"{key}_space": None if space is None else space_to_json(space)
            for key, space in spaces.items()
        },
    }


def _read_header(data: Any, where: str) -> dict[str, Space[Any] | None]:
    """The spaces a header names; raises `ValueError` for an unknown version."""
    if data.get("version") != RECORDS_VERSION:
        raise ValueError(f"{where}: unknown records version {data.get('version')!r}")
    spaces: dict[str, Space[Any] | None] = {}
    for key in _SPACE_FIELDS:
        description = data.get(f"{key}_space")
        spaces[key] = None if description is None else space_from_json(description)
    return spaces


def _decode_record(
    data: Any,
    spaces: Mapping[str, Space[Any] | None],
    where: str,
    decode: Callable[[Space[Any], Any], Any] = value_from_json,
) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(data).__name__}")
    record: dict[str, Any] = {}
    for key, value in data.items():
        space = spaces.get(key)
        if space is not None:
            value = decode(space, value)
        elif key in _REAL_FIELDS and isinstance(value, str) and value in NONFINITE:
            value = NONFINITE[value]
        record[key] = value
    return record


def load_jsonl(path: PathLike) -> RolloutRecords:
    """Read a JSONL file of records, as `save_jsonl` wrote it.

    ``observation`` and ``action`` come back as their spaces' native values (the
    arrays, dtypes and shapes that were saved); a file without a header (plain
    JSONL, one object per line) loads as its objects. Blank lines are skipped.

    Example:
        >>> records = load_jsonl("rollouts.jsonl")
        >>> records.observation_space
        Box([-4.8 ...], [4.8 ...], (4,), float32)

    Args:
        path: The file to read.

    Returns:
        The records, with the header's spaces.

    Raises:
        ValueError: A line is not strict JSON (NaN and Infinity literals
            included) or not an object, the header's version is unknown, or a
            value does not fit its space (`SpaceCodecError`).
    """
    spaces: dict[str, Space[Any] | None] = {"observation": None, "action": None}
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{number}"
            try:
                data = loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            if not records and isinstance(data, dict) and data.get("format") == RECORDS_FORMAT:
                spaces = _read_header(data, where)
                continue
            records.append(_decode_record(data, spaces, where))
    return RolloutRecords(
        records, observation_space=spaces["observation"], action_space=spaces["action"]
    )


def save_binary(
    records: Iterable[Mapping[str, Any]],
    path: PathLike,
    *,
    observation_space: Space[Any] | None = None,
    action_space: Space[Any] | None = None,
) -> None:
    """Write records to a binary file: as `save_jsonl`, with arrays as their raw bytes.

    For observations that are images (or any large arrays): a JSONL line
    writes each number as text, several times a frame's bytes; here a frame
    costs its bytes and a few dozen more (the layout is in the module's
    docstring). Every field that is not an observation or an action is
    written as `save_jsonl` writes it.

    Example:
        >>> records = run_episodes(url, policy, episodes=4)  # a Pong server
        >>> save_binary(records, "pong.records")
        >>> load_binary("pong.records")[0]["observation"].shape
        (210, 160, 3)

    Args:
        records: Dicts, e.g. what `run_episodes` returns.
        path: The file to write (replaced if it exists).
        observation_space: As for `save_jsonl`.
        action_space: As for `save_jsonl`.

    Raises:
        ValueError: An ``observation`` or ``action`` holds numpy data but no
            space is known for it.
        SpaceCodecError: A value does not fit its space.
    """
    spaces = _spaces_of(records, observation_space, action_space)
    frames = [frame(_json_bytes(_header(spaces, encoding="binary")), [])]
    for number, record in enumerate(records):
        blobs: list[Buffer] = []
        encode = functools.partial(_value_to_blobs, blobs)
        frames.append(frame(_json_bytes(_encode_record(record, spaces, number, encode)), blobs))
    # Everything is encoded before the file opens, so a bad record leaves no half file.
    with open(path, "wb") as file:
        file.write(BINARY_MAGIC)
        for data in frames:
            file.write(_LENGTH.pack(len(data)))
            file.write(data)
            file.write(bytes(-len(data) & 7))


def _value_to_blobs(blobs: list[Buffer], space: Space[Any], value: Any) -> dict[str, Any]:
    """A space value as ``{tree, buffers}``, its arrays appended to ``blobs``."""
    tree, buffers = value_to_tree(space, value)
    first = len(blobs)
    blobs.extend(buffers)
    return {"tree": tree, "buffers": list(range(first, len(blobs)))}


def _value_from_blobs(blobs: list[memoryview], where: str, space: Space[Any], value: Any) -> Any:
    """The space value a ``{tree, buffers}`` names (`_value_to_blobs`)."""
    if not isinstance(value, dict) or value.keys() != {"tree", "buffers"}:
        raise ValueError(f"{where}: a value must be {{tree, buffers}}")
    indices = value["buffers"]
    if not isinstance(indices, list) or not all(
        type(i) is int and 0 <= i < len(blobs) for i in indices
    ):
        raise ValueError(f"{where}: buffers must name blobs of the frame")
    return value_from_tree(space, value["tree"], [blobs[i] for i in indices])


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()


def _frames(data: memoryview, where: str) -> Iterator[tuple[int, memoryview]]:
    """The frames of a `save_binary` file's bytes, each with its offset."""
    if data[: len(BINARY_MAGIC)] != BINARY_MAGIC:
        raise ValueError(f"{where}: not a binary records file (it does not start with the magic)")
    offset = len(BINARY_MAGIC)
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise ValueError(f"{where}: truncated at byte {offset}")
        (length,) = _LENGTH.unpack_from(data, offset)
        start = offset + _LENGTH.size
        if start + length > len(data):
            raise ValueError(f"{where}: truncated frame at byte {offset}")
        yield offset, data[start : start + length]
        offset = start + length + (-length & 7)


def load_binary(path: PathLike) -> RolloutRecords:
    """Read a file `save_binary` wrote: the records, bit-exact, with their spaces.

    The file is read into one buffer; every array of the records is a
    writable view of it (no copy per array), so keeping one array keeps the
    whole buffer: ``array.copy()`` one to keep it alone.

    Raises:
        ValueError: The file is not such a file, is truncated, its header's
            version is unknown, or a value does not fit its space
            (`SpaceCodecError`).
    """
    with open(path, "rb") as file:
        data = memoryview(bytearray(file.read()))
    name = os.fspath(path)
    spaces: dict[str, Space[Any] | None] | None = None
    records: list[dict[str, Any]] = []
    for offset, data_frame in _frames(data, name):
        where = f"{name}@{offset}"
        head, blobs = unframe(data_frame, where)
        if spaces is None:
            if not isinstance(head, dict) or head.get("format") != RECORDS_FORMAT:
                raise ValueError(f"{where}: the first frame is not a records header")
            spaces = _read_header(head, where)
            continue
        decode = functools.partial(_value_from_blobs, blobs, where)
        records.append(_decode_record(head, spaces, where, decode))
    if spaces is None:
        raise ValueError(f"{name}: no records header")
    return RolloutRecords(
        records, observation_space=spaces["observation"], action_space=spaces["action"]
    )


def to_dataframe(records: Iterable[Mapping[str, Any]]) -> pandas.DataFrame:
    """Records as a pandas DataFrame: one row per record, one column per field.

    Columns come in the records' key order; an ``observation`` or ``action``
    column holds each record's value as it is (an array per row for a Box:
    ``numpy.stack(df["observation"])`` makes one array of them), and a nested
    dict (``/run``'s ``verify``) stays one dict per row.

    Example:
        >>> df = to_dataframe(run_episodes(url, policy, episodes=20, num_envs=4))
        >>> df.groupby("episode")["reward"].sum().describe()

    Raises:
        ImportError: pandas is not installed (``pip install 'gym-sessions[pandas]'``).
    """
    try:
        import pandas
    except ImportError as exc:
        raise ImportError(
            "to_dataframe needs pandas, which is not installed: "
            "pip install 'gym-sessions[pandas]' (or pip install pandas)"
        ) from exc
    rows = [dict(record) for record in records]
    return pandas.DataFrame.from_records(rows) if rows else pandas.DataFrame()
