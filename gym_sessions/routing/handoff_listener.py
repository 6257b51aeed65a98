"""The holder's side of connection handoff: take client connections other workers give it.

`HandoffListener` listens on a ``SOCK_SEQPACKET`` Unix socket in the runtime
directory (mode 0600 in a 0700 directory) and reads it from the event loop
(``add_reader``, no thread). It takes connections only from processes of this
uid (``SO_PEERCRED``), one descriptor per message (extra ones are closed),
messages at most `MAX_MESSAGE_BYTES`. Each message gets exactly one answer
byte, in order, never lost: taken (sent before the connection is served, so
a worker whose socket ended before an answer served nothing) or refused (this
worker does not hold the session, is draining or stopping, or the message is
malformed).

A taken connection is served by the public server's own protocol (same head
bounds, timeouts, connection set and concurrency limit as a connection it
accepted itself), after its first request, the replay, is fed in: bytes the
client sent meanwhile are held until then (`_ReplayFirst`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

from gym_sessions.routing.handoff import (
    ACK_REFUSED,
    ACK_TAKEN,
    MAX_MESSAGE_BYTES,
    unpack_message,
)

__all__ = ["HandoffListener"]

logger = logging.getLogger("gym_sessions.routing")

_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Descriptors read per message: one expected; room for a few more so that
# extras are received (and closed) rather than left to the kernel's truncation.
_MAX_FDS = 4
_STREAM_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX)
#: A taken connection: its socket, the replayed request, the id of the worker that sent it.
_Taken = tuple[socket.socket, bytes, str]


class _ReplayFirst(asyncio.Protocol):
    """Feeds the replayed request to ``inner`` before any byte read from the connection.

    The loop may start reading the handed socket before ``connection_made``
    runs; what arrives that early is held. Once the replay is in, the
    transport talks to ``inner`` directly.
    """

    def __init__(self, inner: Any, replay: bytes, sender: str) -> None:
        self.inner = inner
        self.replay = replay
        self.sender = sender
        self.early: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but are one.
        self.transport = cast("asyncio.Transport", transport)
        inner = self.inner
        inner.connection_made(transport)
        inner.expect_replay(self.sender)
        inner.data_received(self.replay)
        self.replay = b""
        for data in self.early:
            if transport.is_closing():
                break
            inner.data_received(data)
        self.early.clear()
        transport.set_protocol(inner)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            self.early.append(data)
        else:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _refusal(fds: int, flags: int, well_formed: bool) -> str | None:
    """Why a message is refused whoever sent it, or ``None``."""
    if fds != 1:
        return f"{fds} descriptors (one expected)"
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return "message or descriptors truncated"
    if not well_formed:
        return "malformed message"
    return None


class HandoffListener:
    """Takes handed-over client connections on the socket at ``path``.

    Args:
        path: The socket path (`RuntimeDirectory.handoff_path`).
        takes: Whether this worker takes a connection for a session id now
            (it holds the session and is neither draining nor stopping).
    """

    def __init__(self, path: str, takes: Callable[[str], bool]) -> None:
        self.path = path
        self.takes = takes
        self.taken = 0
        self.refused = 0
        self._new_protocol: Callable[[], Any] | None = None
        self._accepting: Callable[[], bool] = lambda: False
        self._listening: socket.socket | None = None
        self._peers: set[socket.socket] = set()
        # Per peer: answers its socket could not take yet, each with its connection.
        self._unsent: dict[socket.socket, collections.deque[tuple[bytes, _Taken | None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._uid = os.getuid()

    def attach(self, new_protocol: Callable[[], Any], accepting: Callable[[], bool]) -> None:
        """Serve taken connections with ``new_protocol()`` while ``accepting()`` holds.

        ``new_protocol`` makes the public server's protocol for one connection,
        a `BoundedHttpProtocol`; until attached every message is refused.
        """
        self._new_protocol = new_protocol
        self._accepting = accepting

    async def start(self) -> None:
        """Start listening."""
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a killed predecessor's (worker ids are unique, but be sure)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        self._listening = sock
        self._loop.add_reader(sock.fileno(), self._accept)

    async def stop(self) -> None:
        """Stop listening and close every peer's socket (their open questions are lost)."""
        if self._listening is None:
            return
        assert self._loop is not None
        self._loop.remove_reader(self._listening.fileno())
        self._listening.close()
        self._listening = None
        for peer in list(self._peers):
            self._drop(peer)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        assert self._listening is not None and self._loop is not None
        while True:
            try:
                peer, _ = self._listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("handoff socket: accept failed: %s", exc)
                return
            try:
                _, uid, _ = _PEER_CREDENTIALS.unpack(
                    peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
                )
            except OSError:
                uid = -1
            if uid != self._uid:
                # The directory is 0700, so only root gets here; still, never its descriptors.
                logger.warning("handoff socket: refused a peer of uid %d", uid)
                peer.close()
                continue
            peer.setblocking(False)
            self._peers.add(peer)
            self._loop.add_reader(peer.fileno(), self._receive, peer)

    def _drop(self, peer: socket.socket) -> None:
        """Close ``peer``; connections taken but not yet answered there are closed unserved."""
        assert self._loop is not None
        self._peers.discard(peer)
        with contextlib.suppress(Exception):
            self._loop.remove_reader(peer.fileno())
        with contextlib.suppress(Exception):
            self._loop.remove_writer(peer.fileno())
        for _, client in self._unsent.pop(peer, ()):
            if client is not None:
                client[0].close()
        peer.close()

    def _receive(self, peer: socket.socket) -> None:
        while peer in self._peers and peer not in self._unsent:
            try:
                message, fds, flags, _ = socket.recv_fds(peer, MAX_MESSAGE_BYTES, _MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(peer)
                return
            if not message and not fds:
                self._drop(peer)  # the other worker closed its end
                return
            self._answer(peer, self._take(message, fds, flags))

    def _answer(self, peer: socket.socket, client: _Taken | None) -> None:
        """Answer one message; a taken connection is served once its answer is sent.

        Answering before serving is what lets the asking worker read the end
        of this socket as "served nothing". When the answer cannot be sent
        now (the asker is slow to read and this socket's buffer is full), it
        waits here, in order, with its connection unserved, and no further
        message is read until every waiting answer is out: the answers are
        never lost and never reordered, so the asker never mistakes a taken
        connection for one it may serve itself.
        """
        answer = ACK_TAKEN if client is not None else ACK_REFUSED
        if peer in self._unsent:
            self._unsent[peer].append((answer, client))
            return
        try:
            peer.send(answer)
        except (BlockingIOError, InterruptedError):
            assert self._loop is not None
            self._unsent[peer] = collections.deque([(answer, client)])
            self._loop.remove_reader(peer.fileno())
            self._loop.add_writer(peer.fileno(), self._send_unsent, peer)
            return
        except OSError:
            # The asking worker is gone: it reads no answer and serves nothing,
            # and neither does this one (the connection was never answered).
            if client is not None:
                client[0].close()
            self._drop(peer)
            return
        self._served(client)

    def _send_unsent(self, peer: socket.socket) -> None:
        assert self._loop is not None
        unsent = self._unsent.get(peer)
        while unsent:
            answer, client = unsent[0]
            try:
                peer.send(answer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(peer)  # closes every connection still unanswered
                return
            unsent.popleft()
            self._served(client)
        self._unsent.pop(peer, None)
        if peer in self._peers:
            self._loop.remove_writer(peer.fileno())
            self._loop.add_reader(peer.fileno(), self._receive, peer)

    def _served(self, client: _Taken | None) -> None:
        """Count an answered message; serve its connection if it was taken."""
        if client is None:
            self.refused += 1
            return
        self.taken += 1
        assert self._loop is not None
        self._loop.create_task(self._serve(*client))

    def _take(self, message: bytes, fds: list[int], flags: int) -> _Taken | None:
        """The client socket and replay of a message this worker takes, else ``None``.

        Every descriptor not taken is closed here.
        """
        unpacked = unpack_message(message)
        refusal = _refusal(len(fds), flags, unpacked is not None)
        if refusal is None and (self._new_protocol is None or not self._accepting()):
            refusal = "this worker serves no handed connection now (starting, draining, stopping)"
        if refusal is None and unpacked is not None and not self.takes(unpacked[0]):
            refusal = "this worker does not hold the session"
        if refusal is not None:
            logger.debug("handoff refused: %s", refusal)
        wanted = refusal is None
        client = None
        if wanted:
            try:
                client = socket.socket(fileno=fds[0])
            except OSError:
                client = None
            if client is not None and (
                client.type != socket.SOCK_STREAM or client.family not in _STREAM_FAMILIES
            ):
                client.detach()
                client = None
        for fd in fds[1:] if client is not None else fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if client is None or unpacked is None:
            return None
        client.setblocking(False)
        return client, unpacked[2], unpacked[1]

    async def _serve(self, client: socket.socket, replay: bytes, sender: str) -> None:
        assert self._loop is not None and self._new_protocol is not None
        new_protocol = self._new_protocol
        try:
            await self._loop.connect_accepted_socket(
                lambda: _ReplayFirst(new_protocol(), replay, sender), client
            )
        except Exception:
            logger.exception("handoff: could not serve a taken connection")
            client.close()
