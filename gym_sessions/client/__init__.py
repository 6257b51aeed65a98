"""Clients: the Gymnasium API on remote environments, blocking, async and vectorised."""

from gym_sessions.client.async_remote_env import AsyncRemoteEnv
from gym_sessions.client.connection_pool import ConnectionPool
from gym_sessions.client.protocol import EnvDescription
from gym_sessions.client.records import (
    RolloutRecords,
    load_binary,
    load_jsonl,
    save_binary,
    save_jsonl,
    to_dataframe,
)
from gym_sessions.client.remote_env import RemoteEnv
from gym_sessions.client.rollouts import run_episodes
from gym_sessions.client.vector_env import RemoteVectorEnv
from gym_sessions.errors import ConnectionLostError, ReplyTimeoutError

__all__ = [
    "AsyncRemoteEnv",
    "ConnectionLostError",
    "ConnectionPool",
    "EnvDescription",
    "RemoteEnv",
    "RemoteVectorEnv",
    "ReplyTimeoutError",
    "RolloutRecords",
    "load_binary",
    "load_jsonl",
    "run_episodes",
    "save_binary",
    "save_jsonl",
    "to_dataframe",
]
