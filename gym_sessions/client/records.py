"""Rollout records to and from JSONL files, and into pandas DataFrames.

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

pandas is imported only by `to_dataframe` (``pip install 'gym-sessions[pandas]'``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gymnasium.spaces import Space

from gym_sessions.spaces import space_from_json, space_to_json, value_from_json, value_to_json
from gym_sessions.spaces._arrays import NONFINITE
from gym_sessions.spaces.values import to_jsonable
from gym_sessions.strict_json import loads

if TYPE_CHECKING:
    import pandas

__all__ = ["RECORDS_FORMAT", "RolloutRecords", "load_jsonl", "save_jsonl", "to_dataframe"]

#: The header's ``format``; a file whose first line lacks it holds records only.
RECORDS_FORMAT = "gym-sessions/records"
RECORDS_VERSION = 1

#: Fields written through a space when one is known.
_SPACE_FIELDS = ("observation", "action")
#: Real-valued fields whose non-finite strings load back as floats.
_REAL_FIELDS = frozenset({"reward", "episode_return"})

PathLike = str | os.PathLike[str]


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
    record: Mapping[str, Any], spaces: Mapping[str, Space[Any] | None], line: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        space = spaces.get(key)
        if space is not None:
            out[key] = value_to_json(space, value)
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
    header = {
        "format": RECORDS_FORMAT,
        "version": RECORDS_VERSION,
        **{
            f"{key}_space": None if space is None else space_to_json(space)
            for key, space in spaces.items()
        },
    }
    # Encode everything before opening the file, so a bad record leaves no half file.
    lines = [header] + [
        _encode_record(record, spaces, number) for number, record in enumerate(records)
    ]
    with open(path, "w", encoding="utf-8") as file:
        for data in lines:
            file.write(json.dumps(data, allow_nan=False, separators=(",", ":")) + "\n")


def _decode_record(
    data: Any, spaces: Mapping[str, Space[Any] | None], where: str
) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(data).__name__}")
    record: dict[str, Any] = {}
    for key, value in data.items():
        space = spaces.get(key)
        if space is not None:
            value = value_from_json(space, value)
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
                if data.get("version") != RECORDS_VERSION:
                    raise ValueError(f"{where}: unknown records version {data.get('version')!r}")
                for key in spaces:
                    description = data.get(f"{key}_space")
                    spaces[key] = None if description is None else space_from_json(description)
                continue
            records.append(_decode_record(data, spaces, where))
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
