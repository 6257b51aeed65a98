"""Adapters from gym-sessions' clients to other RL libraries, one module per library.

Nothing here is imported by ``import gym_sessions``: each module needs its
library's optional extra (``pip install 'gym-sessions[sb3]'`` for
`gym_sessions.integrations.sb3`).
"""
