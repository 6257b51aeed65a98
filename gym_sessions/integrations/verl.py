"""verl's tool interface (``BaseTool``) on a gym-sessions resources server.

`SessionTool` is a ``verl.tools.base_tool.BaseTool`` for one MCP tool of the
server; a verl ``tool_config`` YAML lists one per tool (`tool_config` writes it
from the server's listing). Every `SessionTool` of one server shares the
sessions: **one session per trajectory**, not per instance id, because verl's
``ToolAgentLoop`` (0.9) calls ``create``, ``execute`` and ``release`` around
every single tool call and passes the trajectory only as ``execute``'s
``agent_data``:

- ``create(create_kwargs=...)`` returns a new instance id and remembers the
  kwargs (the sample's ``tools_kwargs[tool]["create_kwargs"]``), which become
  the start body (`gym_sessions.integrations.trl.start_body`: ``seed``,
  ``options``, ``task_id``, ``task_data``);
- ``execute(instance_id, parameters, agent_data=...)`` calls the tool on the
  trajectory's session, which the first call starts (a new id and
  ``session_key``, key-protected as every client's session); concurrent calls
  of one turn wait for that start;
- ``release(instance_id)`` forgets the instance id only: the session lives on
  for the trajectory's next calls;
- ``calc_reward(instance_id, agent_data=...)`` is the trajectory's ``/verify``
  reward (asked once; the verify ends the session).

Without ``agent_data`` (a caller that keeps an instance per trajectory) the
session is the instance id's own and ``release`` closes it.

When the trajectory ends: `GymSessionsToolAgentLoop` (registered as the agent
loop ``gym_sessions_tool_agent``) runs verl's ``ToolAgentLoop`` inside a
`trajectory_scope`, which verifies each session the run opened, sets the
output's ``reward_score`` to the ``/verify`` reward (verl then skips its
reward function, as for agent loops that score themselves) and closes the
session. With the plain ``tool_agent`` loop a session is closed when its
``AgentData`` is collected, right after the run, or at interpreter exit
(`gym_sessions.client.lifecycle`), and is never verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
except ImportError as exc:
    raise ImportError(
        "gym_sessions.integrations.verl needs verl: pip install 'gym-sessions[verl]'"
    ) from exc

from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.exchange import Request
from gym_sessions.client.lifecycle import close_at_exit
from gym_sessions.client.protocol import session_names, start_request
from gym_sessions.client.tls import tls_context
from gym_sessions.errors import GymSessionsError, ToolError
from gym_sessions.integrations.trl import (
    ToolSession,
    argument_text,
    list_tools,
    start_body,
    tool_call_request,
    tool_result_text,
)
from gym_sessions.server.mcp import SESSION_TOKEN_HEADER_NAME

__all__ = [
    "GymSessionsToolAgentLoop",
    "SessionTool",
    "TrajectoryScope",
    "openai_schema",
    "tool_config",
    "trajectory_scope",
]

logger = logging.getLogger(__name__)

#: ``config`` keys of a `SessionTool` besides verl's own ``type``.
_CLIENT_KEYS = ("headers", "verify", "cert", "timeout", "keep_alive", "retries")


class _Trajectory:
    """One trajectory's session: started by its first call, verified and closed once."""

    def __init__(self, url: str, options: Mapping[str, Any]) -> None:
        self.http = AsyncHTTPClient(url, **options)
        self.session = ToolSession()
        self.session.new()
        self.verification: dict[str, Any] | None = None
        self._started: asyncio.Future[None] | None = None

    @property
    def session_id(self) -> str:
        return self.session.session_id

    async def ensure_started(self, start_route: str, body: Mapping[str, Any]) -> None:
        """Start the session once; concurrent callers wait for that start (and its error)."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                self.session.started = True
                names = session_names(self.session.session_id, self.session.session_key)
                request = start_request(start_route, names, body, first=True)
                reply = (await self.http.send(request)).json()
                self.session.token = reply["mcp"]["headers"][SESSION_TOKEN_HEADER_NAME]
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started.exception()  # retrieved: no "never retrieved" warning
                raise
            self._started.set_result(None)
        else:
            await asyncio.shield(self._started)

    async def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        if self.session.token is None or self.session.closed:
            raise GymSessionsError(f"tool {name!r}: the trajectory's session is closed")
        reply = await self.http.send(tool_call_request(self.session.token, name, arguments))
        return tool_result_text(name, reply.json())

    async def verify(self) -> dict[str, Any]:
        """``/verify`` once (cached); the verify ends the session."""
        if self.verification is None:
            if self.session.token is None or self.session.closed:
                raise GymSessionsError("calc_reward needs the trajectory's open session")
            self.session.claim_close()
            self.verification = (await self.http.send(Request("POST", "/verify", {}))).json()
        return self.verification

    async def close(self) -> None:
        """Close the session if still open, then the connection; never raises."""
        request = self.session.claim_close()
        if request is not None:
            with contextlib.suppress(Exception):
                await self.http.send(request)
        with contextlib.suppress(Exception):
            await self.http.close()


class _Sessions:
    """The trajectories of one server, by verl's ``AgentData`` (held weakly) or instance id."""

    def __init__(self, url: str, options: Mapping[str, Any]) -> None:
        self.url = url
        self.options = dict(options)
        self.by_agent: weakref.WeakKeyDictionary[Any, _Trajectory] = weakref.WeakKeyDictionary()
        self.by_instance: dict[str, _Trajectory] = {}

    def of_agent(self, agent_data: Any) -> _Trajectory:
        trajectory = self.by_agent.get(agent_data)
        if trajectory is None:
            trajectory = self.by_agent[agent_data] = _Trajectory(self.url, self.options)
            # Closed when the AgentData is collected (the run is over) or at exit.
            close_at_exit(
                agent_data, trajectory.http, trajectory.session, trajectory.http.close_soon
            )
            scope = _SCOPE.get()
            if scope is not None:
                scope.trajectories.append(trajectory)
        return trajectory

    def of_instance(self, instance_id: str) -> _Trajectory:
        trajectory = self.by_instance.get(instance_id)
        if trajectory is None:
            trajectory = self.by_instance[instance_id] = _Trajectory(self.url, self.options)
        return trajectory


#: One `_Sessions` per server URL and client options: the tools of one server share them.
_SERVERS: dict[tuple[str, str], _Sessions] = {}


def _sessions(url: str, config: Mapping[str, Any], options: Mapping[str, Any]) -> _Sessions:
    """The sessions of ``url`` shared by the tools whose client ``config`` is the same.

    Keyed by the config's values, not ``options``: each tool builds its own TLS context.
    """
    key = (url, repr(sorted((k, repr(config[k])) for k in _CLIENT_KEYS if k in config)))
    if key not in _SERVERS:
        _SERVERS[key] = _Sessions(url, options)
    return _SERVERS[key]


class SessionTool(BaseTool):
    """One MCP tool of a resources server as a verl tool; see the module docstring.

    ``config`` (the YAML entry's ``config``): ``type: native`` (verl's), ``url``,
    ``tool`` (the MCP tool's name; defaults to ``tool_schema``'s name), and
    optionally ``start_route`` (``/seed_session``), ``tools`` (the start's
    ``mcp_tools``) and the client options ``headers``, ``verify``, ``cert``,
    ``timeout``, ``keep_alive``, ``retries`` as `environment_class` takes them.
    Without a ``tool_schema`` the server is asked for it (a probe session).
    """

    def __init__(
        self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None
    ) -> None:
        self.url = str(config["url"]).rstrip("/")
        self.start_route = str(config.get("start_route", "/seed_session"))
        tools = config.get("tools")
        self.mcp_tools: list[str] | None = None if tools is None else list(tools)
        self.tool = str(config.get("tool") or (tool_schema.function.name if tool_schema else ""))
        if not self.tool:
            raise ValueError("a SessionTool needs config.tool or a tool_schema")
        options = {
            k: config[k] for k in _CLIENT_KEYS if k in config and k not in ("verify", "cert")
        }
        options["ssl_context"] = tls_context(
            self.url, config.get("verify", True), config.get("cert")
        )
        self.client_options = options
        self._sessions = _sessions(self.url, config, options)
        self._create_kwargs: dict[str, dict[str, Any]] = {}
        self.tool_schema = tool_schema
        super().__init__(config, tool_schema or self._listed_schema())

    def _listed_schema(self) -> OpenAIFunctionToolSchema:
        listed = list_tools(self.url, self.client_options, self.start_route, self.mcp_tools)
        for schema in listed:
            if schema["name"] == self.tool:
                return openai_schema(schema)
        raise ValueError(f"{self.url} lists no tool {self.tool!r}: {[t['name'] for t in listed]}")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        self._create_kwargs[instance_id] = dict(kwargs.get("create_kwargs") or {})
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        trajectory = self._trajectory(instance_id, kwargs.get("agent_data"))
        body = start_body(self._create_kwargs.get(instance_id, {}))
        if self.mcp_tools is not None:
            body["mcp_tools"] = list(self.mcp_tools)
        await trajectory.ensure_started(self.start_route, body)
        try:
            text = await trajectory.call(self.tool, parameters)
        except ToolError as exc:  # the tool's own failure: the model sees it
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"tool_error": 1}
        return ToolResponse(text=text), 0.0, {"session_id": trajectory.session_id}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        trajectory = self._trajectory(instance_id, kwargs.get("agent_data"))
        return float((await trajectory.verify())["reward"])

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._create_kwargs.pop(instance_id, None)
        trajectory = self._sessions.by_instance.pop(instance_id, None)
        if trajectory is not None:
            await trajectory.close()

    def _trajectory(self, instance_id: str, agent_data: Any) -> _Trajectory:
        if agent_data is None:
            return self._sessions.of_instance(instance_id)
        return self._sessions.of_agent(agent_data)


# The end of a trajectory -------------------------------------------------------------------------


class TrajectoryScope:
    """The sessions opened inside one `trajectory_scope`, verified and closed at its end.

    Attributes:
        trajectories: Each opened session, in order of first call.
        verifications: Their ``/verify`` replies (with ``session_id``), or the error
            that verify raised, once the scope has ended.
    """

    def __init__(self) -> None:
        self.trajectories: list[_Trajectory] = []
        self.verifications: list[dict[str, Any] | GymSessionsError] = []

    @property
    def reward(self) -> float | None:
        """The last verified session's reward (``None``: none opened, or its verify failed)."""
        for verification in reversed(self.verifications):
            return None if isinstance(verification, Exception) else float(verification["reward"])
        return None

    async def finish(self, verify: bool = True) -> None:
        for trajectory in self.trajectories:
            if verify and trajectory.session.token is not None:
                try:
                    reply = await trajectory.verify()
                    self.verifications.append({**reply, "session_id": trajectory.session_id})
                except GymSessionsError as exc:
                    self.verifications.append(exc)
            await trajectory.close()


_SCOPE: contextvars.ContextVar[TrajectoryScope | None] = contextvars.ContextVar(
    "gym_sessions_verl_scope", default=None
)


@contextlib.asynccontextmanager
async def trajectory_scope(verify: bool = True) -> AsyncIterator[TrajectoryScope]:
    """Collect the sessions opened inside; at the end verify them (optionally) and close them.

    Tasks started inside (``asyncio.gather`` of one turn's calls) share the scope;
    concurrent trajectories each run in a scope of their own.
    """
    scope = TrajectoryScope()
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)
        await scope.finish(verify)


@register("gym_sessions_tool_agent")
class GymSessionsToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` whose trajectory is scored by ``/verify`` and its session closed."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        async with trajectory_scope() as scope:
            output = await super().run(sampling_params, **kwargs)
        if scope.verifications:
            reward = scope.reward
            if reward is None:
                logger.warning("verify failed: %s", scope.verifications[-1])
            elif output.reward_score is None:
                output.reward_score = reward
            output.extra_fields["gym_sessions_verify"] = scope.verifications[-1]
        return output


# Schemas and the tool config --------------------------------------------------------------------


def openai_schema(tool: Mapping[str, Any]) -> OpenAIFunctionToolSchema:
    """verl's OpenAI function schema of an MCP ``Tool``.

    verl's property schema keeps ``type``, ``description`` and ``enum`` only, so
    bounds (``minimum``, ``maxLength``, ...) go into the description.
    """
    input_schema = tool.get("inputSchema") or {}
    properties = {
        name: {
            "type": prop.get("type", "string"),
            "description": argument_text(prop),
            **({"enum": prop["enum"]} if isinstance(prop.get("enum"), list) else {}),
        }
        for name, prop in (input_schema.get("properties") or {}).items()
    }
    description = " ".join(str(tool.get("description") or f"The {tool['name']} tool.").split())
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": list(input_schema.get("required") or []),
                },
            },
        }
    )


def tool_config(
    url: str,
    *,
    tools: Sequence[str] | None = None,
    start_route: str = "/seed_session",
    **client_options: Any,
) -> dict[str, Any]:
    """verl's ``tool_config`` (as a dict: dump it to YAML) with one `SessionTool` per server tool.

    The server is asked once, here (a probe session), so each entry carries its
    ``tool_schema`` and the trainer does not ask again.
    """
    options = {k: v for k, v in client_options.items() if k not in ("verify", "cert")}
    options["ssl_context"] = tls_context(
        url, client_options.get("verify", True), client_options.get("cert")
    )
    listed = list_tools(url, options, start_route, None if tools is None else list(tools))
    config: dict[str, Any] = {"type": "native", "url": url, "start_route": start_route}
    if tools is not None:
        config["tools"] = list(tools)
    config.update(client_options)
    return {
        "tools": [
            {
                "class_name": f"{__name__}.SessionTool",
                "config": {**config, "tool": tool["name"]},
                "tool_schema": openai_schema(tool).model_dump(exclude_none=True),
            }
            for tool in listed
        ]
    }
