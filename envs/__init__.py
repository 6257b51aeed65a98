"""Example environments served by gym-sessions.

In the repository this folder is the package ``envs`` (``gym-sessions serve
envs.counter:CounterEnv`` from the repository root); an installed gym-sessions
carries the same modules as ``gym_sessions.examples`` (no top-level ``envs``
package is installed, so a user's own ``envs/`` is never shadowed), and
registers the example envs with Gymnasium: ``gym-sessions serve
gym_sessions/Counter-v0``. The modules import each other relatively so that
both names work.
"""
