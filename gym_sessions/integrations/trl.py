"""TRL's ``GRPOTrainer(environment_factory=...)`` on a gym-sessions resources server.

`environment_class` asks the server which MCP tools a session gets and builds
a class that TRL can use as its environment factory:

- a no-argument constructor (TRL makes one instance per rollout and pools them);
- ``reset(**row)`` starts a session of the instance's own (a new id and
  ``session_key``, as every client start is key-protected) with the dataset
  row as the task, and returns the server's first observation as text, which
  TRL appends to the prompt;
- one public method per MCP tool, with a real signature, type hints and a
  Google-style docstring made from the tool's JSON schema and description, so
  TRL's schema extraction (``transformers.utils.get_json_schema``) shows the
  model exactly the server's tools; a call goes to ``/mcp`` with the
  session's token;
- ``get_reward()`` asks ``/verify`` once per session (TRL makes it a reward
  of its own, logged under the class name); the verify ends the session.

A session that was not verified is closed when TRL resets the instance for
its next rollout, when the instance is collected, at interpreter exit, or by
the class's ``close_all()``. Each instance keeps its own connection, so the
sessions of one trainer are accepted by, and placed on, all of the server's
workers; the router keeps every call on its session's holder.

How the row becomes the start body (``reset``): the fields a start declares
(`TYPED_START_FIELDS`: ``seed``, ``options``, ``task_id``, ``task_data``) are
sent as they are; without a ``task_data`` field, the row's other fields
(less ``prompt``, which TRL renders itself) are sent as ``task_data``.
"""

from __future__ import annotations

import inspect
import json
import keyword
import secrets
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from gym_sessions.client.exchange import Request
from gym_sessions.client.http import HTTPClient
from gym_sessions.client.lifecycle import close_at_exit, close_session_quietly
from gym_sessions.client.protocol import close_request, session_names, start_request
from gym_sessions.client.tls import CertOption, VerifyOption, tls_context
from gym_sessions.errors import GymSessionsError, InvalidRequestError, ToolError
from gym_sessions.server.mcp import MCP_PATH, SESSION_TOKEN_HEADER_NAME

__all__ = [
    "TYPED_START_FIELDS",
    "SessionEnvironment",
    "ToolSession",
    "argument_text",
    "environment_class",
    "list_tools",
    "tool_call_request",
    "tool_result_text",
]

#: Row fields sent as typed start fields (docs/design.md §3.2, §3.2.1).
TYPED_START_FIELDS = ("seed", "options", "task_id", "task_data")
#: The row's conversation: TRL renders it, the server never needs it.
_PROMPT_FIELD = "prompt"
#: Names TRL reads itself, so no tool may take them.
_RESERVED = frozenset({"reset", "get_reward", "close_all"})

_JSON_TYPES: dict[str, Any] = {
    "integer": int,
    "number": float,
    "string": str,
    "boolean": bool,
    "object": dict[str, Any],
    "null": type(None),
}


class ToolSession:
    """A session reached by its MCP tools: id, key and token; closed at most once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.session_id = ""
        self.session_key = ""
        self.token: str | None = None
        self.started = False
        self.closed = True

    def new(self) -> None:
        self.session_id = uuid.uuid4().hex
        self.session_key = secrets.token_urlsafe(32)
        self.token = None
        self.started = False
        self.closed = False

    def claim_close(self) -> Request | None:
        """Mark the session closed; its close request the first time, if it started."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
        if not self.started:
            return None
        return close_request(session_names(self.session_id, self.session_key))


class SessionEnvironment:
    """One rollout's session on a resources server; `environment_class` makes the subclasses.

    The subclass's public methods other than ``reset`` and ``get_reward`` are
    the server's tools. Class attributes (set by `environment_class`):

    Attributes:
        url: The server's URL.
        tool_schemas: The tools as the server lists them (MCP ``Tool`` objects).
    """

    url: ClassVar[str]
    tool_schemas: ClassVar[tuple[dict[str, Any], ...]]
    _client_options: ClassVar[dict[str, Any]]
    _start_route: ClassVar[str]
    _mcp_tools: ClassVar[list[str] | None]
    _instances: ClassVar[weakref.WeakSet[SessionEnvironment]]

    def __init__(self) -> None:
        self._http = HTTPClient(self.url, **self._client_options)
        self._session = ToolSession()
        #: The last ``/verify`` reply of the current session (``None`` before).
        self.verification: dict[str, Any] | None = None
        close_at_exit(self, self._http, self._session, self._http.close)
        self._instances.add(self)

    @property
    def session_id(self) -> str:
        """The current session's id (empty before the first ``reset``)."""
        return self._session.session_id

    def reset(self, **row: Any) -> str | None:
        """Start a new session with ``row`` as its task; returns the first observation as text.

        The previous session of this instance, if still open, is closed first.
        """
        self._close_session()
        self.verification = None
        self._session.new()
        names = session_names(self._session.session_id, self._session.session_key)
        body = start_body(row)
        if self._mcp_tools is not None:
            body["mcp_tools"] = list(self._mcp_tools)
        self._session.started = True
        reply = self._http.send(start_request(self._start_route, names, body, first=True)).json()
        self._session.token = reply["mcp"]["headers"][SESSION_TOKEN_HEADER_NAME]
        return observation_text(reply.get("observation"))

    def get_reward(self) -> float:
        """The session's reward from ``/verify`` (asked once; the verify ends the session)."""
        if self.verification is None:
            if not self._session.started or self._session.closed:
                raise InvalidRequestError("get_reward needs an open session: call reset first")
            # Verify without close-follows ends the session: nothing is left to close.
            self._session.claim_close()
            self.verification = self._http.send(Request("POST", "/verify", {})).json()
        return float(self.verification["reward"])

    @classmethod
    def close_all(cls) -> None:
        """Close the open sessions of every instance of this class (after training, say)."""
        for instance in list(cls._instances):
            instance._close_session()

    def _close_session(self) -> None:
        close_session_quietly(self._http, self._session)

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """``tools/call`` on the current session; the result's text, or `ToolError`."""
        if self._session.token is None or self._session.closed:
            raise InvalidRequestError(f"tool {name!r} needs an open session: call reset first")
        reply = self._http.send(tool_call_request(self._session.token, name, arguments))
        return tool_result_text(name, reply.json())


def tool_call_request(token: str, name: str, arguments: Mapping[str, Any]) -> Request:
    """``tools/call`` of ``name`` on the session whose MCP token is ``token``."""
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": name, "arguments": dict(arguments)},
    }
    return Request("POST", MCP_PATH, message, {SESSION_TOKEN_HEADER_NAME: token})


def tool_result_text(name: str, reply: Mapping[str, Any]) -> str:
    """A ``tools/call`` reply's text; `ToolError` for the tool's own failure.

    Raises:
        InvalidRequestError: the call itself was refused (a JSON-RPC error).
        ToolError: the tool ran and failed (``isError``).
    """
    if "error" in reply:
        raise InvalidRequestError(str(reply["error"].get("message")))
    result = reply["result"]
    text = "\n".join(
        part.get("text", "") for part in result.get("content", []) if part.get("type") == "text"
    )
    if result.get("isError"):
        raise ToolError(f"{name}: {text}")
    return text


def start_body(row: Mapping[str, Any]) -> dict[str, Any]:
    """The start body for a dataset row (see the module docstring)."""
    body = {name: row[name] for name in TYPED_START_FIELDS if name in row}
    if "task_data" not in row:
        rest = {k: v for k, v in row.items() if k not in TYPED_START_FIELDS and k != _PROMPT_FIELD}
        if rest:
            body["task_data"] = rest
    return body


def observation_text(observation: Any) -> str | None:
    """A start reply's observation as the text TRL appends to the prompt (JSON unless a string)."""
    if observation is None or isinstance(observation, str):
        return observation
    return json.dumps(observation)


# Building the class ------------------------------------------------------------------------------


def environment_class(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    verify: VerifyOption = True,
    cert: CertOption | None = None,
    timeout: float = 60.0,
    keep_alive: bool = True,
    retries: int = 1,
    tools: Sequence[str] | None = None,
    start_route: str = "/seed_session",
    name: str = "GymSessionsEnv",
) -> type[SessionEnvironment]:
    """A class for ``GRPOTrainer(environment_factory=...)`` whose instances are sessions on ``url``.

    The server is asked once, here, which tools a session gets (a probe
    session is started, listed and closed).

    Args:
        url: The resources server, ``http://host:port`` or ``https://...``.
        headers: Extra headers sent with every request (an authenticating proxy's, say).
        verify: For an ``https://`` URL: check the server's certificate against
            the system's CAs (``True``), a CA file's (a path), or not at all
            (``False``); or an `ssl.SSLContext` of your own, as every client
            takes it (`gym_sessions.client.tls`).
        cert: A client certificate for an ``https://`` server or proxy that
            asks for one: a PEM file, or a ``(certificate, key)`` pair of files.
        timeout: Seconds to wait for a connect and for each reply.
        keep_alive: One kept-alive connection per instance (the default), or a
            new connection per request.
        retries: Resends of a request whose reply was lost, where that is safe.
        tools: Limit each session to these tools (the start's ``mcp_tools``).
        start_route: The start route (``/seed_session`` or ``/reset``).
        name: The class name; TRL logs the reward under it.

    Returns:
        A `SessionEnvironment` subclass with one method per tool.

    Raises:
        ValueError: a tool or argument name cannot be a Python method or
            parameter, or clashes with ``reset``/``get_reward``/``close_all``.
        GymSessionsError: the server could not be asked.
    """
    ssl_context = tls_context(url, verify, cert)
    options: dict[str, Any] = {
        "timeout": timeout,
        "keep_alive": keep_alive,
        "retries": retries,
        "headers": headers,
        "ssl_context": ssl_context,
    }
    mcp_tools = None if tools is None else list(tools)
    schemas = list_tools(url, options, start_route, mcp_tools)
    namespace: dict[str, Any] = {
        "url": url.rstrip("/"),
        "tool_schemas": tuple(schemas),
        "_client_options": options,
        "_start_route": start_route,
        "_mcp_tools": mcp_tools,
        "_instances": weakref.WeakSet(),
        "__doc__": f"Sessions on {url} (gym_sessions.integrations.trl).",
        "__module__": __name__,
    }
    for schema in schemas:
        namespace[schema["name"]] = tool_method(schema)
    return type(name, (SessionEnvironment,), namespace)


def list_tools(
    url: str, options: Mapping[str, Any], start_route: str, mcp_tools: list[str] | None
) -> list[dict[str, Any]]:
    """The tools a session lists (MCP ``Tool`` objects), asked of a probe session.

    ``options`` are `HTTPClient`'s keyword arguments (a new connection per request is used).
    """
    http = HTTPClient(url, **{**options, "keep_alive": False})
    session = ToolSession()
    session.new()
    session.started = True
    body: dict[str, Any] = {} if mcp_tools is None else {"mcp_tools": mcp_tools}
    names = session_names(session.session_id, session.session_key)
    try:
        reply = http.send(start_request(start_route, names, body, first=True)).json()
        token = reply["mcp"]["headers"][SESSION_TOKEN_HEADER_NAME]
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        answer = http.send(
            Request("POST", MCP_PATH, listing, {SESSION_TOKEN_HEADER_NAME: token}, resendable=True)
        ).json()
        if "error" in answer:
            raise GymSessionsError(f"tools/list on {url}: {answer['error'].get('message')}")
        return list(answer["result"]["tools"])
    finally:
        close_session_quietly(http, session)
        http.close()


def tool_method(schema: Mapping[str, Any]) -> Callable[..., str]:
    """A method calling the MCP tool ``schema`` describes, typed and documented from it.

    Required properties become parameters without a default, the others
    default to ``None`` (and are not sent when left out). Each property's type
    hint comes from its JSON type (``enum`` as ``Literal``); its description,
    with the bounds a type hint cannot carry, goes into the ``Args:`` section.
    """
    name = schema["name"]
    _check_identifier(name, f"tool {name!r}")
    if name in _RESERVED or name.startswith("_"):
        raise ValueError(f"tool {name!r} clashes with a name TRL or this class reads itself")
    input_schema = schema.get("inputSchema") or {}
    properties: dict[str, Any] = input_schema.get("properties") or {}
    required = set(input_schema.get("required") or [])
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    # Required parameters first: a Python signature cannot put one after a default.
    ordered = sorted(properties, key=lambda arg: arg not in required)
    for arg in ordered:
        _check_identifier(arg, f"argument {arg!r} of tool {name!r}")
        hint = _type_hint(properties[arg])
        if arg in required:
            parameter = inspect.Parameter(
                arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hint
            )
        else:
            hint = hint | None
            parameter = inspect.Parameter(
                arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=hint
            )
        parameters.append(parameter)
        annotations[arg] = hint
    annotations["return"] = str
    signature = inspect.Signature(parameters, return_annotation=str)

    def call(self: SessionEnvironment, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(self, *args, **kwargs)  # TypeError as a real method's
        arguments = {
            arg: value
            for arg, value in bound.arguments.items()
            if arg != "self" and not (value is None and arg not in required)
        }
        return self._call_tool(name, arguments)

    call.__name__ = call.__qualname__ = name
    call.__signature__ = signature  # type: ignore[attr-defined]
    call.__annotations__ = annotations
    call.__doc__ = _docstring(schema, ordered, properties)
    return call


def _check_identifier(text: str, what: str) -> None:
    if not isinstance(text, str) or not text.isidentifier() or keyword.iskeyword(text):
        raise ValueError(f"{what} is not a Python identifier, so it cannot be a TRL tool")


def _type_hint(prop: Mapping[str, Any]) -> Any:
    """The Python type hint of one JSON schema property."""
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return Literal[tuple(prop["enum"])]  # built at run time
    kind = prop.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    hints: list[Any] = []
    for each in kinds:
        if each == "array":
            items = prop.get("items")
            item: Any = _type_hint(items) if isinstance(items, dict) else Any
            hints.append(list[item])
        elif each in _JSON_TYPES:
            hints.append(_JSON_TYPES[each])
        else:
            hints.append(Any)
    hint: Any = hints[0]
    for other in hints[1:]:
        hint = hint | other
    return hint


def _docstring(schema: Mapping[str, Any], ordered: list[str], properties: Mapping[str, Any]) -> str:
    """A Google-style docstring: the tool's description, then one ``Args:`` line per argument."""
    description = " ".join(str(schema.get("description") or f"The {schema['name']} tool.").split())
    lines = [description]
    if ordered:
        lines += ["", "Args:"]
        for arg in ordered:
            lines.append(f"    {arg}: {argument_text(properties[arg])}")
    lines += ["", "Returns:", "    The tool's result as JSON text."]
    return "\n".join(lines)


_BOUNDS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("minItems", "items >="),
    ("maxItems", "items <="),
)


def argument_text(prop: Mapping[str, Any]) -> str:
    """One argument's description with the constraints its type hint cannot say."""
    text = " ".join(str(prop.get("description") or "").split()) or "the argument"
    bounds = [f"{word} {prop[key]}" for key, word in _BOUNDS if key in prop]
    if "pattern" in prop:
        bounds.append(f"matching {prop['pattern']}")
    if bounds:
        text += f" ({', '.join(bounds)})"
    return text
