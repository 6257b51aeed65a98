"""Where ``gym-sessions serve`` takes its secret from: a private file, the environment, or nowhere.

- ``--secret-file PATH``: read once by the supervisor. Refused unless it is a
  regular file that only its owner may read or write (``chmod 600``) holding
  one line of at least `MIN_SECRET_LENGTH` characters.
- ``$GYM_SESSIONS_SECRET``: at least `MIN_SECRET_LENGTH` characters too.
  The supervisor removes it from its environment once read, so no process it
  starts inherits it, and blanks it in the environment block it was started
  with, which ``/proc/<pid>/environ`` shows (and which forked workers share).
- Neither: no secret here; `gym_sessions.settings.Settings` then picks a
  random one per start (and refuses to, with Redis claims).

A file given with ``--secret-file`` wins over the environment (the command line
is the more explicit of the two). A secret given on the command line itself
(``--secret S``) is refused: every user can read any process's command line
(``ps``, ``/proc/<pid>/cmdline``).

Secrets built into `Settings` by Python code are not checked here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from gym_sessions.errors import StartupError
from gym_sessions.settings import SECRET_ENV

__all__ = [
    "COMMAND_LINE_SECRET_REFUSAL",
    "MIN_SECRET_LENGTH",
    "read_secret_file",
    "server_secret",
    "take_secret_from_environment",
    "write_secret_file",
]

MIN_SECRET_LENGTH = 32
# A secret file holds one line; anything much larger is not a secret file.
_MAX_SECRET_FILE_BYTES = 4096
_MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"

COMMAND_LINE_SECRET_REFUSAL = (
    "--secret is refused: every user can read a command line (ps, /proc/PID/cmdline); "
    "put the secret in a file only you can read (chmod 600) and pass --secret-file PATH, "
    f"or set {SECRET_ENV}"
)


def read_secret_file(path: str, kind: str = "secret") -> str:
    """The secret held in the file at ``path``, without its trailing newline.

    Args:
        path: The file.
        kind: What the file holds, for error messages (``secret``, ``metrics
            token``): every such file follows the same rules.

    Raises:
        StartupError: the file is missing or unreadable, not a regular file,
            open to group or others, not one line of UTF-8 text, or the secret
            is shorter than `MIN_SECRET_LENGTH` characters; the path is a
            symbolic link.
    """
    what = f"{kind} file {path}"
    try:
        # O_NONBLOCK: a FIFO given by mistake must not block the start (it is
        # refused below). O_NOFOLLOW: a symbolic link is refused, so whoever can
        # write the directory cannot point the server at another file it reads.
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StartupError(f"{what} is a symbolic link; name the file itself") from exc
        raise StartupError(f"cannot read {what}: {exc.strerror or exc}") from exc
    try:
        # Checked on the open file, so the file read is the file checked.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StartupError(f"{what} is not a regular file")
        if info.st_mode & 0o077:
            raise StartupError(
                f"{what} is open to group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); make it private: chmod 600 {path}"
            )
        content = _read_at_most(fd, _MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise StartupError(f"cannot read {what}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(content) > _MAX_SECRET_FILE_BYTES:
        raise StartupError(
            f"{what} is larger than {_MAX_SECRET_FILE_BYTES} bytes: "
            f"it should hold the {kind} on one line"
        )
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise StartupError(f"{what} is not UTF-8 text") from None
    secret = text.removesuffix("\n").removesuffix("\r")
    if "\n" in secret or "\r" in secret:
        # Hosts sharing a secret must read the same value; a second line is a mistake.
        raise StartupError(f"{what} holds more than one line")
    _check_length(secret, f"the {kind} in {path}")
    return secret


def take_secret_from_environment() -> str | None:
    """``$GYM_SESSIONS_SECRET`` (None when unset or empty), removed from this process's environment.

    Removing it keeps it out of the environment of every process started
    afterwards (workers, interpreters of environments). Its value is also
    overwritten with zero bytes in the environment block this process was
    started with, where ``/proc/<pid>/environ`` would show it to root and a
    forked worker would carry it; the secret stays in this process's memory,
    which is why the server makes itself non-dumpable (`gym_sessions.non_dumpable`).

    Raises:
        StartupError: it is shorter than `MIN_SECRET_LENGTH` characters.
    """
    _blank_in_initial_environment(SECRET_ENV)
    secret = os.environ.pop(SECRET_ENV, None)
    if not secret:
        return None
    _check_length(secret, SECRET_ENV)
    return secret


def _blank_in_initial_environment(name: str) -> None:
    """Overwrite ``name``'s value with zero bytes where the C library's ``environ`` keeps it.

    Before `os.environ` drops the variable (``unsetenv`` would remove the
    pointer, not the bytes). Where the C library has no ``environ`` symbol,
    nothing is done.
    """
    try:
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError, TypeError):  # pragma: no cover - no such symbol (not glibc/musl)
        return
    prefix = name.encode() + b"="
    index = 0
    while (address := environ[index]) is not None:
        entry = ctypes.string_at(address)
        if entry.startswith(prefix):
            ctypes.memset(address + len(prefix), 0, len(entry) - len(prefix))
        index += 1


def server_secret(secret_file: str | None) -> str | None:
    """The secret a server started from the command line signs with; None: pick one at random.

    ``$GYM_SESSIONS_SECRET`` is removed from the environment whichever source wins.

    Raises:
        StartupError: the chosen source is refused (see `read_secret_file`,
            `take_secret_from_environment`).
    """
    if secret_file is not None:
        _blank_in_initial_environment(SECRET_ENV)  # unused: shown nowhere, inherited by nobody
        os.environ.pop(SECRET_ENV, None)
        return read_secret_file(secret_file)
    return take_secret_from_environment()


def write_secret_file(path: str, secret: str) -> None:
    """Create ``path`` (mode 0600, must not exist yet) holding ``secret`` and a newline.

    For scripts and tests that start servers; by hand:
    ``umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > secret``.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _check_length(secret: str, what: str) -> None:
    if len(secret) < MIN_SECRET_LENGTH:
        raise StartupError(
            f"{what} is {len(secret)} characters long; a secret needs at least "
            f"{MIN_SECRET_LENGTH} (make one with {_MAKE_ONE})"
        )
