"""gym-sessions: serve stateful Gymnasium environments from several uvicorn workers.

The client API lives here: the Gymnasium API on a remote environment, blocking
(`RemoteEnv`), asyncio (`AsyncRemoteEnv`) and vectorised (`RemoteVectorEnv`),
`run_episodes` for batches of rollouts, and the one exception hierarchy that
server and client share (`GymSessionsError` and its subclasses). What a server
author needs is in `gym_sessions.server`; the JSON codec of spaces in
`gym_sessions.spaces`. Other modules are internal.

Importing the package registers ``gym_sessions/Remote-v0`` and the example envs
(``gym_sessions/Counter-v0``)::

    import gymnasium
    import gym_sessions  # noqa: F401  (registers the remote env)

    env = gymnasium.make("gym_sessions/Remote-v0", url="http://127.0.0.1:8000")

Importing it loads neither Starlette nor the server, and the client only
when one of its names is first used.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from gym_sessions._lazy_names import lazy_names
from gym_sessions._registration import register_envs
from gym_sessions.errors import (
    BadGatewayError,
    BadUpstreamError,
    BodyTooLargeError,
    CapacityReachedError,
    ClaimsUnavailableError,
    ConnectionLostError,
    EnvError,
    ForbiddenError,
    ForbiddenTargetError,
    GatewayTimeoutError,
    GymSessionsError,
    HeadersTooLargeError,
    HTTPError,
    InternalServerError,
    InvalidBinaryError,
    InvalidJSONError,
    InvalidRequestError,
    InvalidSessionIdError,
    InvalidTokenError,
    MethodNotAllowedError,
    NoOpenEpisodeError,
    NotFoundError,
    NotReadyError,
    OverloadedError,
    RefusedReplyError,
    ReplyTimeoutError,
    RequestTimeoutError,
    ServerUnreachableError,
    ServiceUnavailableError,
    SessionClosedError,
    SessionConflictError,
    SessionExpiredError,
    SessionGoneError,
    StartupError,
    StatusError,
    StepOutOfOrderError,
    ToolError,
    TooManyRequestsError,
    UnsupportedMediaTypeError,
)

if TYPE_CHECKING:
    from gym_sessions.client import (
        AsyncRemoteEnv,
        ConnectionPool,
        EnvDescription,
        RemoteEnv,
        RemoteVectorEnv,
        run_episodes,
    )

try:
    __version__ = version("gym-sessions")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AsyncRemoteEnv",
    "BadGatewayError",
    "BadUpstreamError",
    "BodyTooLargeError",
    "CapacityReachedError",
    "ClaimsUnavailableError",
    "ConnectionLostError",
    "ConnectionPool",
    "EnvDescription",
    "EnvError",
    "ForbiddenError",
    "ForbiddenTargetError",
    "GatewayTimeoutError",
    "GymSessionsError",
    "HTTPError",
    "HeadersTooLargeError",
    "InternalServerError",
    "InvalidBinaryError",
    "InvalidJSONError",
    "InvalidRequestError",
    "InvalidSessionIdError",
    "InvalidTokenError",
    "MethodNotAllowedError",
    "NoOpenEpisodeError",
    "NotFoundError",
    "NotReadyError",
    "OverloadedError",
    "RefusedReplyError",
    "RemoteEnv",
    "RemoteVectorEnv",
    "ReplyTimeoutError",
    "RequestTimeoutError",
    "ServerUnreachableError",
    "ServiceUnavailableError",
    "SessionClosedError",
    "SessionConflictError",
    "SessionExpiredError",
    "SessionGoneError",
    "StartupError",
    "StatusError",
    "StepOutOfOrderError",
    "TooManyRequestsError",
    "ToolError",
    "UnsupportedMediaTypeError",
    "__version__",
    "register_envs",
    "run_episodes",
]

# The client (numpy codecs, its connections, the vector loop) loads on first use:
# a server's workers import this package but never the client.
__getattr__, __dir__ = lazy_names(
    globals(),
    dict.fromkeys(
        (
            "AsyncRemoteEnv",
            "ConnectionPool",
            "EnvDescription",
            "RemoteEnv",
            "RemoteVectorEnv",
            "run_episodes",
        ),
        "gym_sessions.client",
    ),
    __all__,
)

register_envs()
