"""The TLS settings of an ``https://`` URL, from the two options every client takes.

``verify`` and ``cert`` mean what they mean for ``requests``:

- ``verify=True`` (the default) checks the server's certificate against the
  system's CAs and its name against the URL's host; a path checks it against
  the CA certificates in that PEM file (or ``c_rehash`` directory) instead;
  ``False`` checks nothing (a test server's self-signed certificate); an
  `ssl.SSLContext` of your own is used as it is.
- ``cert`` is a client certificate, for a server or proxy that asks for one:
  one PEM file holding the certificate and its key, or a
  ``(certificate, key)`` pair of files.

An ``http://`` URL ignores both. `RemoteVectorEnv` builds one context for all
its sub-envs and hands it on as their ``verify``.
"""

from __future__ import annotations

import functools
import os
import ssl
from urllib.parse import urlsplit

__all__ = ["CertOption", "VerifyOption", "default_context", "tls_context"]

Path = str | os.PathLike[str]
#: ``True``, ``False``, a CA file or directory, or an `ssl.SSLContext`.
VerifyOption = bool | Path | ssl.SSLContext
#: A PEM file with certificate and key, or a ``(certificate, key)`` pair.
CertOption = Path | tuple[Path, Path]


@functools.cache
def default_context() -> ssl.SSLContext:
    """The system's CAs, hostname checks: one context for every client (never change it).

    Loading the CAs takes milliseconds; a vector env's or an agent's many
    sessions share this one.
    """
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])
    return context


def tls_context(
    url: str, verify: VerifyOption = True, cert: CertOption | None = None
) -> ssl.SSLContext | None:
    """The TLS context for ``url`` (``None`` for ``http://``), as the module says.

    Raises:
        ValueError: ``cert`` with an `ssl.SSLContext` (load it into the context).
        OSError: a CA or certificate file cannot be read.
        ssl.SSLError: a file holds no certificate or key, or they do not match.
    """
    if urlsplit(url).scheme != "https":
        return None
    if isinstance(verify, ssl.SSLContext):
        if cert is not None:
            raise ValueError("cert= cannot go with an ssl.SSLContext: load it into the context")
        return verify
    if verify is True and cert is None:
        return default_context()
    if verify is True or verify is False:
        context = ssl.create_default_context()
        if verify is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    elif os.path.isdir(verify):
        context = ssl.create_default_context(capath=verify)
    else:
        context = ssl.create_default_context(cafile=verify)
    if cert is not None:
        certfile, keyfile = cert if isinstance(cert, tuple) else (cert, None)
        context.load_cert_chain(certfile, keyfile)
    context.set_alpn_protocols(["http/1.1"])
    return context
