"""The upstreams an agent server may call: env servers and model servers, fixed at start-up.

An agent server is started with the list (``--allow-env [NAME=]URL``,
``--allow-model [NAME=]URL``; `Settings.allowed_envs`, `Settings.allowed_models`).
A request body picks one of them by its name or by its exact URL
(`UpstreamTargets.resolve`); anything else is refused with 400
``forbidden_target`` before any connection is made. The agent's HTTP pool
refuses any other URL as well (`gym_sessions.server.egress`), so an agent's own
code cannot reach past the list either (docs/security.md).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from gym_sessions.errors import ForbiddenTargetError

__all__ = ["Upstream", "UpstreamTargets"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# How much of a refused reference the error repeats (it is the client's own text).
_SHOWN = 120


@dataclass(frozen=True)
class Upstream:
    """One allowed upstream: its base URL (no trailing ``/``) and the name it goes by, if any."""

    url: str
    name: str | None = None

    @classmethod
    def parse(cls, spec: str, flag: str) -> Upstream:
        """``[NAME=]URL`` as given to ``flag``.

        Raises:
            ValueError: not an ``http(s)://host[:port][/path]`` URL, or a bad name.
        """
        name: str | None = None
        head, sep, tail = spec.partition("=")
        if sep and "/" not in head and ":" not in head:
            name, spec = head, tail
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"{flag} {name}=...: a name is 1-64 letters, digits, '_', '.' or '-'"
                )
        return cls(_base_url(spec, flag), name)

    def covers(self, url: str) -> bool:
        """Whether ``url`` is this upstream's base URL or a path under it (any query).

        Scheme, host and port are compared as parsed (an explicit default port
        is the same port), the path as a prefix of whole segments.
        """
        mine, theirs = _origin_and_path(self.url), _origin_and_path(url)
        if mine is None or theirs is None or mine[0] != theirs[0]:
            return False
        return theirs[1] == mine[1] or theirs[1].startswith(mine[1] + "/")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_and_path(url: str) -> tuple[tuple[str, str, int], str] | None:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None:
        return None
    segments = urllib.parse.unquote(parts.path).split("/")
    if "." in segments or ".." in segments:
        return None  # a path that climbs out of the base is under no base
    origin = (parts.scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[parts.scheme])
    return origin, parts.path.rstrip("/")


def _base_url(url: str, flag: str) -> str:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{flag} {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r}: not an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{flag} {url!r}: a URL with credentials in it is not allowed")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError(f"{flag} {url!r}: a base URL has no query or fragment")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host if port is None else f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


@dataclass(frozen=True)
class UpstreamTargets:
    """The upstreams of one kind (``env`` or ``model``) an agent server may call.

    Args:
        kind: ``"env"`` or ``"model"`` (names the flag in errors).
        upstreams: The allowed upstreams, in the order given.
    """

    kind: str
    upstreams: tuple[Upstream, ...] = ()

    @classmethod
    def parse(cls, kind: str, specs: tuple[str, ...]) -> UpstreamTargets:
        """The targets ``--allow-<kind>`` gave (each ``[NAME=]URL``).

        Raises:
            ValueError: a spec is malformed, or two name different URLs with one name.
        """
        flag = f"--allow-{kind}"
        upstreams: list[Upstream] = []
        for spec in specs:
            upstream = Upstream.parse(spec, flag)
            named = [u for u in upstreams if upstream.name and u.name == upstream.name]
            if named and named[0].url != upstream.url:
                raise ValueError(f"{flag}: the name {upstream.name!r} is given to two URLs")
            if upstream not in upstreams:
                upstreams.append(upstream)
        return cls(kind, tuple(upstreams))

    @property
    def flag(self) -> str:
        return f"--allow-{self.kind}"

    def resolve(self, reference: str) -> str:
        """The base URL ``reference`` (a name, or one of the URLs exactly) stands for.

        A trailing ``/`` is ignored; nothing else is: another path, a query, a
        fragment, credentials or another spelling of the host are refused.

        Raises:
            ForbiddenTargetError: it is none of the allowed upstreams.
        """
        for upstream in self.upstreams:
            if reference == upstream.name:
                return upstream.url
        bare = reference[:-1] if reference.endswith("/") else reference
        for upstream in self.upstreams:
            if bare == upstream.url:
                return upstream.url
        shown = reference if len(reference) <= _SHOWN else reference[:_SHOWN] + "..."
        if not self.upstreams:
            raise ForbiddenTargetError(
                f"{shown!r}: this agent server may call no {self.kind} server (its operator "
                f"starts it with {self.flag} URL)"
            )
        names = [u.name for u in self.upstreams if u.name]
        choice = f"one of the names {', '.join(names)} or " if names else ""
        raise ForbiddenTargetError(
            f"{shown!r} is not a {self.kind} server this agent may call: give {choice}"
            f"an exact URL its operator allowed ({self.flag})"
        )

    def covers(self, url: str) -> bool:
        """Whether ``url`` is one of the upstreams' base URLs or a path under one."""
        return any(upstream.covers(url) for upstream in self.upstreams)
