"""A TLS endpoint on loopback for the tests: throwaway certificates and a TLS-terminating proxy.

`make_certificates` writes a CA, a server certificate for ``127.0.0.1`` and
``localhost`` and a client certificate, all signed by that CA, with the
``cryptography`` package. `TLSProxy` accepts TLS on 127.0.0.1 (asking for a
client certificate if told to) and splices each connection's plain bytes to
one connection to the upstream server, so a client's kept-alive connection
stays one connection to one worker, as without the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import ssl
import threading
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Certificates", "TLSProxy", "make_certificates"]


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA's certificate, the server's and the client's (each with its key),
    and the client's certificate and key in one file."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    client_combined: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: str, *parts: bytes) -> str:
    with open(path, "wb") as file:
        file.write(b"".join(parts))
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_certificates(directory: str) -> Certificates:
    """Write a fresh CA, server and client certificate (valid for a day) into ``directory``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("gym-sessions test CA"))
        .issuer_name(_name("gym-sessions test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        common_name: str, usage: x509.ObjectIdentifier, names: list[x509.GeneralName]
    ) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    server_cert, server_key = leaf(
        "127.0.0.1",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    client_cert, client_key = leaf("gym-sessions test client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    return Certificates(
        ca=_write(path("ca.pem"), ca_cert.public_bytes(serialization.Encoding.PEM)),
        server_cert=_write(path("server.pem"), server_cert),
        server_key=_write(path("server.key"), server_key),
        client_cert=_write(path("client.pem"), client_cert),
        client_key=_write(path("client.key"), client_key),
        client_combined=_write(path("client-combined.pem"), client_cert, client_key),
    )


class TLSProxy:
    """TLS on 127.0.0.1 in front of ``upstream`` (``http://host:port``), in its own thread.

    Args:
        upstream: The plain-HTTP server behind it.
        certificates: Its certificate (`Certificates.server_cert`) and the CA it
            checks client certificates against.
        client_certificates: Refuse connections without a client certificate
            that the CA signed.

    Attributes:
        url: ``https://127.0.0.1:<port>``.
        connections: Connections whose TLS handshake succeeded (a refused client
            certificate is not counted).
    """

    def __init__(
        self, upstream: str, certificates: Certificates, *, client_certificates: bool = False
    ) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").rpartition(":")
        self._upstream = (host, int(port))
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificates.server_cert, certificates.server_key)
        if client_certificates:
            self._context.verify_mode = ssl.CERT_REQUIRED
            self._context.load_verify_locations(certificates.ca)
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> str:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", 0, ssl=self._context, ssl_handshake_timeout=10
        )
        return f"https://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._tasks.discard(task)

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until either side ends, then close ``writer``."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
