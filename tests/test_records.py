"""Rollout records: JSONL round trips through the wire codec, DataFrames, optional imports."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_sessions.client import (
    RolloutRecords,
    load_binary,
    load_jsonl,
    save_binary,
    save_jsonl,
    to_dataframe,
)
from gym_sessions.client.records import BINARY_MAGIC, RECORDS_FORMAT
from tests.test_spaces import SPACES, assert_same_space, assert_same_value

CARTPOLE_OBS = gym.spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)

floats = st.floats(allow_nan=True, allow_infinity=True)
workers = st.none() | st.text(max_size=12)


def same_float(a: float, b: float) -> bool:
    return type(a) is type(b) is float and (a == b or (math.isnan(a) and math.isnan(b)))


def step_record(episode: int, observation: Any, action: Any, reward: float) -> dict[str, Any]:
    return {
        "episode": episode,
        "step": 0,
        "env_index": 1,
        "worker": "4242-1a2b3c4d",
        "observation": observation,
        "action": action,
        "reward": reward,
        "terminated": False,
        "truncated": True,
    }


def _saved_and_loaded(records: RolloutRecords, binary: bool) -> RolloutRecords:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "records"
        if binary:
            records.save_binary(path)
            return load_binary(path)
        records.save_jsonl(path)
        for line in path.read_text().splitlines():
            json.loads(line, parse_constant=pytest.fail)  # strict JSON, no NaN literals
        return load_jsonl(path)


@pytest.mark.parametrize("binary", [False, True], ids=["jsonl", "binary"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    observation_name=st.sampled_from(sorted(SPACES)),
    action_name=st.sampled_from(sorted(SPACES)),
    seed=st.integers(0, 2**32 - 1),
    rewards=st.lists(floats, min_size=0, max_size=4),
    worker=workers,
)
def test_step_records_round_trip_exactly(
    binary, observation_name, action_name, seed, rewards, worker
):
    observation_space, action_space = SPACES[observation_name], SPACES[action_name]
    observation_space.seed(seed)
    action_space.seed(seed + 1)
    records = RolloutRecords(
        [
            {
                **step_record(i, observation_space.sample(), action_space.sample(), r),
                "worker": worker,
            }
            for i, r in enumerate(rewards)
        ],
        observation_space=observation_space,
        action_space=action_space,
    )
    loaded = _saved_and_loaded(records, binary)
    assert_same_space(loaded.observation_space, observation_space)
    assert_same_space(loaded.action_space, action_space)
    assert len(loaded) == len(records)
    for got, want in zip(loaded, records, strict=True):
        assert list(got) == list(want)
        assert_same_value(want["observation"], got["observation"])
        assert_same_value(want["action"], got["action"])
        assert same_float(got["reward"], want["reward"]), (got["reward"], want["reward"])
        for key in ("episode", "step", "env_index", "worker", "terminated", "truncated"):
            assert got[key] == want[key] and type(got[key]) is type(want[key])


run_results = st.fixed_dictionaries(
    {
        "reward": floats,
        "episode_return": floats,
        "episode_length": st.integers(0, 10**6),
        "env_session_id": st.text(min_size=1, max_size=40),
        "verify": st.fixed_dictionaries(
            {"reward": st.floats(allow_nan=False, allow_infinity=False), "ok": st.booleans()}
        ),
    }
)


@settings(max_examples=40, deadline=None)
@given(results=st.lists(run_results, max_size=5))
def test_agent_run_results_round_trip(results):
    # /run replies are JSON already (no spaces): the file holds them as they came.
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "runs.jsonl"
        save_jsonl(results, path)
        loaded = load_jsonl(path)
    assert loaded.observation_space is None and loaded.action_space is None
    assert len(loaded) == len(results)
    for got, want in zip(loaded, results, strict=True):
        assert same_float(got["reward"], want["reward"])
        assert same_float(got["episode_return"], want["episode_return"])
        assert {k: got[k] for k in ("episode_length", "env_session_id", "verify")} == {
            k: want[k] for k in ("episode_length", "env_session_id", "verify")
        }


def test_the_file_is_a_header_then_one_record_per_line(tmp_path):
    records = RolloutRecords(
        [step_record(0, np.array([0.5, -0.0, np.inf, np.nan], dtype=np.float32), np.int64(1), 1.0)],
        observation_space=CARTPOLE_OBS,
        action_space=gym.spaces.Discrete(2),
    )
    path = tmp_path / "r.jsonl"
    save_jsonl(records, path)
    header, line = (json.loads(text) for text in path.read_text().splitlines())
    assert header["format"] == RECORDS_FORMAT and header["version"] == 1
    assert header["action_space"]["type"] == "Discrete"
    assert line["observation"] == [0.5, -0.0, "inf", "nan"]  # as the wire writes it
    assert line["action"] == 1 and line["truncated"] is True
    loaded = load_jsonl(path)
    assert loaded[0]["observation"].dtype == np.float32
    assert loaded[0]["action"] == 1 and isinstance(loaded[0]["action"], np.int64)


def test_a_binary_file_holds_each_frame_as_its_bytes(tmp_path):
    frames = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
    frames.seed(0)
    records = RolloutRecords(
        [step_record(i, frames.sample(), np.int64(i % 6), 0.0) for i in range(20)],
        observation_space=frames,
        action_space=gym.spaces.Discrete(6),
    )
    save_binary(records, tmp_path / "pong.records")
    save_jsonl(records, tmp_path / "pong.jsonl")
    raw = 20 * 210 * 160 * 3
    binary, text = (
        (tmp_path / "pong.records").stat().st_size,
        (tmp_path / "pong.jsonl").stat().st_size,
    )
    assert raw < binary < raw + 20 * 512  # the frames' bytes and a small head each
    assert text > 3 * raw
    loaded = load_binary(tmp_path / "pong.records")
    assert len(loaded) == len(records)
    for got, want in zip(loaded, records, strict=True):
        assert np.array_equal(got["observation"], want["observation"])
    observation = loaded[3]["observation"]
    assert observation.dtype == np.uint8 and observation.flags.writeable
    assert observation.ctypes.data % 8 == 0  # aligned in the file's buffer


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: b"not a records file" + data, "not a binary records file"),
        (lambda data: data[:-9], "truncated"),
        (lambda data: data[:12], "truncated"),
        (lambda data: data[: len(BINARY_MAGIC)], "no records header"),
    ],
    ids=["no-magic", "cut-in-a-frame", "cut-in-a-length", "magic-only"],
)
def test_a_damaged_binary_file_is_refused_with_where(tmp_path, damage, message):
    records = RolloutRecords(
        [step_record(0, np.zeros(4, dtype=np.float32), np.int64(1), 1.0)],
        observation_space=CARTPOLE_OBS,
        action_space=gym.spaces.Discrete(2),
    )
    path = tmp_path / "r.records"
    save_binary(records, path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        load_binary(path)


def test_numpy_values_without_a_space_are_refused_with_the_fix(tmp_path):
    record = step_record(0, np.zeros(4, dtype=np.float32), np.int64(0), 1.0)
    with pytest.raises(ValueError, match="pass observation_space="):
        save_jsonl([record], tmp_path / "r.jsonl")
    assert not (tmp_path / "r.jsonl").exists()  # nothing half written
    # A filtered list (a plain list) saves with the spaces given.
    save_jsonl(
        [record],
        tmp_path / "r.jsonl",
        observation_space=CARTPOLE_OBS,
        action_space=gym.spaces.Discrete(2),
    )
    assert_same_value(load_jsonl(tmp_path / "r.jsonl")[0]["observation"], record["observation"])
    # Plain JSON observations need no space.
    save_jsonl([step_record(0, [1, 2], 0, 1.0)], tmp_path / "plain.jsonl")
    assert load_jsonl(tmp_path / "plain.jsonl")[0]["observation"] == [1, 2]


def test_other_fields_are_made_json_safe_as_info_dicts_are(tmp_path):
    record = {"reward": np.float32(0.5), "info": {"hits": np.array([1, 2]), "t": (1, np.inf)}}
    save_jsonl([record], tmp_path / "r.jsonl")
    (loaded,) = load_jsonl(tmp_path / "r.jsonl")
    assert loaded == {"reward": 0.5, "info": {"hits": [1, 2], "t": [1, "inf"]}}


def test_plain_jsonl_without_a_header_loads(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"reward": 1.0, "episode_return": "-inf"}\n\n{"reward": "nan"}\n')
    first, second = load_jsonl(path)
    assert first == {"reward": 1.0, "episode_return": -math.inf}
    assert math.isnan(second["reward"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"reward": NaN}\n', r"r\.jsonl:1: NaN is not valid JSON"),
        (f'{{"format": "{RECORDS_FORMAT}", "version": 99}}\n', "unknown records version 99"),
        (f'{{"format": "{RECORDS_FORMAT}", "version": 1}}\n[1, 2]\n', r":2: a record must be"),
    ],
)
def test_bad_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "r.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_observation_that_does_not_fit_the_header_space_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    save_jsonl(
        [step_record(0, np.zeros(4, dtype=np.float32), np.int64(0), 1.0)],
        path,
        observation_space=CARTPOLE_OBS,
        action_space=gym.spaces.Discrete(2),
    )
    header, line = path.read_text().splitlines()
    path.write_text(header + "\n" + line.replace("[0.0,0.0,0.0,0.0]", "[0.0]") + "\n")
    with pytest.raises(ValueError, match="shape"):
        load_jsonl(path)


def test_dataframe_has_a_row_per_record_and_a_column_per_field():
    records = RolloutRecords(
        [step_record(e, np.full(4, e, dtype=np.float32), np.int64(e % 2), 1.0) for e in (0, 0, 1)],
        observation_space=CARTPOLE_OBS,
        action_space=gym.spaces.Discrete(2),
    )
    frame = records.to_dataframe()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == list(records[0]) and len(frame) == 3
    assert frame.groupby("episode")["reward"].sum().to_dict() == {0: 2.0, 1: 1.0}
    assert frame["reward"].dtype == np.float64 and frame["terminated"].dtype == np.bool_
    np.testing.assert_array_equal(np.stack(frame["observation"]), [[0] * 4, [0] * 4, [1] * 4])
    assert to_dataframe([]).empty


def test_dataframe_of_agent_run_results_keeps_verify_as_dicts():
    results = [
        {"reward": 1.0, "episode_return": 0.0, "episode_length": 3, "verify": {"reward": 1.0}},
        {"reward": 0.0, "episode_return": -1.0, "episode_length": 5, "verify": {"reward": 0.0}},
    ]
    frame = to_dataframe(results)
    assert frame["episode_length"].tolist() == [3, 5]
    assert frame["verify"].tolist() == [{"reward": 1.0}, {"reward": 0.0}]
