"""Clients: the Gymnasium API on remote environments."""

from gym_sessions.client.remote_env import RemoteEnv

__all__ = ["RemoteEnv"]
