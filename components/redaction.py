"""One redaction for every credential this process has seen, applied to everything it prints.

Credentials come from many places: ``--token-file``, ``user:password@`` in ``--host``, a
kubeconfig (bearer token, ``tokenFile``, basic-auth password, client key), the in-cluster service
account token, exec plugins that refresh tokens. Each place *registers* what it read
(:func:`register`, :func:`register_kube_configuration`, :func:`register_kubeconfig`); then
:func:`redact` cuts all of them out of any text, and :class:`RedactingStream` (installed on
stdout/stderr by the CLI) applies it to every line a command writes, whoever produced it: our
messages, an API server's error body echoing the bearer token, pod logs, library warnings.

A value is cut out as a whole token, not wherever its characters occur: a 3-character token
``abc`` must not turn ``abcdef`` into ``<redacted>def`` (that garbles the message and shows the
reader which letters the token has). "Whole" means not flanked by characters a token is made of
(letters, digits, ``-._~+/``, and ``=`` after it; a sentence's final ``.`` does not count). Values of
:data:`ANYWHERE` or more characters are cut out wherever they occur: random strings that long do
not appear in ordinary text by chance, so nothing is garbled, and a token glued to other text is
still caught.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

#: What replaces a secret in any message.
REDACTED = "<redacted>"
#: Values at least this long are cut out wherever they occur, shorter ones only as whole tokens.
ANYWHERE = 16
#: The most we read of a kubeconfig or a token/key file named in one, to find its secrets.
MAX_CREDENTIAL_FILE = 1 << 20

#: ``scheme://user:password@``: the credentials part of a URL.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
# What a token is made of (RFC 6750 b64token). A value flanked by one of these is part of a
# longer word; '=' counts only after it (base64 padding; before it, '=' is key=value), '.' only
# when more token follows (a sentence's end is a boundary).
_TOKEN_CHAR = r"A-Za-z0-9\-_~+/"
_BEFORE = rf"(?<![{_TOKEN_CHAR}.])"
_AFTER = rf"(?![{_TOKEN_CHAR}=]|\.[{_TOKEN_CHAR}])"

#: ``token: value`` (and password, client-key-data) on a kubeconfig line, quoted or not.
_KUBECONFIG_SECRET = re.compile(
    r"""(?:^|[\s{,])(?:token|password|client-key-data)\s*:\s*["']?([^\s"',}#]+)""", re.M)

_lock = threading.Lock()
_values: set[str] = set()
_sources: list[Callable[[], Iterable[Any]]] = []


def _clean(values: Iterable[Any]) -> set[str]:
    out = set()
    for value in values:
        if not isinstance(value, str):
            continue
        value = value.strip()
        scheme, _, rest = value.partition(" ")
        if scheme.lower() in ("bearer", "basic") and rest.strip():
            out.add(rest.strip())  # an Authorization header value: the credential is after it
        elif value:
            out.add(value)
    return out


def register(*values: str) -> None:
    """Remember credential values; every later :func:`redact` cuts them out."""
    cleaned = _clean(values)
    with _lock:
        _values.update(cleaned)


def register_source(source: Callable[[], Iterable[Any]]) -> None:
    """Remember a callable that returns current credential values (tokens that refresh)."""
    with _lock:
        _sources.append(source)


def secrets() -> set[str]:
    """Every credential value known now."""
    with _lock:
        found, sources = set(_values), list(_sources)
    for source in sources:
        try:
            found |= _clean(source())
        except Exception:  # noqa: BLE001, S112 - a broken source must not break printing
            continue
    return found


def _pattern(value: str) -> str:
    escaped = re.escape(value)
    return escaped if len(value) >= ANYWHERE else f"{_BEFORE}{escaped}{_AFTER}"


def redact(text: str, extra: Iterable[str] = ()) -> str:
    """Replace every known credential (and ``user:password@`` in URLs) in ``text``.

    Args:
        text: Anything about to be printed, logged or written to an artifact.
        extra: More values to cut out, besides those registered.

    Returns:
        ``text`` with each credential replaced by :data:`REDACTED`.

    """
    values = secrets() | _clean(extra)
    if values:
        # Longest first, so a value that contains another is cut out whole.
        ordered = sorted(values, key=len, reverse=True)
        text = re.sub("|".join(_pattern(v) for v in ordered), REDACTED, text)
    return _USERINFO.sub(rf"\1{REDACTED}@", text)


def _read_bounded(path: str | Path) -> str:
    """At most :data:`MAX_CREDENTIAL_FILE` bytes of a regular file ('' for anything else).

    Opened without blocking: a FIFO in a kubeconfig's place must not hang the redaction.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_CREDENTIAL_FILE).decode("utf-8", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _key_lines(pem: str) -> list[str]:
    """A PEM key's body lines (what a message quoting the key would show), and the whole."""
    body = [ln.strip() for ln in pem.splitlines() if ln.strip() and "-----" not in ln]
    return [*body, pem] if body else []


def register_kube_configuration(cfg: Any) -> None:
    """Register what a loaded ``kubernetes.client.Configuration`` authenticates with.

    The bearer token (kubeconfig ``token``/``tokenFile``, in-cluster service account, exec
    plugin) is read at every redaction, since a refresh hook may replace it; the basic-auth
    password (also as the ``Basic`` header value the server may echo) and the client key file
    are read once.
    """
    def current() -> list[Any]:
        values = list((getattr(cfg, "api_key", None) or {}).values())
        register(*values)  # kept: a replaced token may still be quoted by a late reply
        return values

    current()
    register_source(current)
    user, password = getattr(cfg, "username", None), getattr(cfg, "password", None)
    if password:
        register(password, base64.b64encode(f"{user or ''}:{password}".encode()).decode())
    key_file = getattr(cfg, "key_file", None)
    if key_file:
        register(*_key_lines(_read_bounded(key_file)))


def register_kubeconfig(paths: str | None) -> None:
    """Register every credential written in kubeconfig files, before the client loads them.

    So that an error while loading (a broken file, a failing exec plugin) cannot print one.

    Args:
        paths: A kubeconfig path or ``$KUBECONFIG``-style list (``:``-separated); None or ''
            means ``$KUBECONFIG`` or ``~/.kube/config``.

    """
    import yaml

    raw = paths or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    for path in filter(None, raw.split(os.pathsep)):
        text = _read_bounded(path)
        # Line by line first: a file YAML cannot parse still has its secrets found.
        register(*(m[1] for m in _KUBECONFIG_SECRET.finditer(text)))
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        users = doc.get("users") if isinstance(doc, dict) else None
        for entry in users if isinstance(users, list) else []:
            user = entry.get("user") if isinstance(entry, dict) else None
            if not isinstance(user, dict):
                continue
            register(*(str(user[k]) for k in ("token", "password", "client-key-data")
                       if user.get(k)))
            if user.get("password"):
                basic = f"{user.get('username') or ''}:{user['password']}"
                register(base64.b64encode(basic.encode()).decode())
            if isinstance(user.get("client-key-data"), str):
                try:
                    pem = base64.b64decode(user["client-key-data"]).decode("ascii", "replace")
                    register(*_key_lines(pem))
                except ValueError:
                    pass
            for key in ("tokenFile", "client-key"):
                if isinstance(user.get(key), str):
                    text = _read_bounded(user[key])
                    register(*(_key_lines(text) if key == "client-key" else [text]))


#: The service account token a pod's kubernetes client loads in-cluster.
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def register_kube_defaults() -> None:
    """Register what the kubernetes client may authenticate with when it loads credentials itself.

    ``TrainingClient()`` without a configuration loads the kubeconfig (or the in-cluster service
    account) into the client's *default* configuration, out of our sight: register the files'
    values now and read the default configuration's token at every redaction.
    """
    register_kubeconfig(None)
    if Path(SERVICE_ACCOUNT_TOKEN).is_file():
        register(_read_bounded(SERVICE_ACCOUNT_TOKEN))

    def current() -> list[Any]:
        from kubernetes import client

        cfg = getattr(client.Configuration, "_default", None)  # set by load_kube_config()
        values = [*((getattr(cfg, "api_key", None) or {}).values()),
                  getattr(cfg, "password", None)] if cfg is not None else []
        register(*values)
        return values

    register_source(current)


#: What a terminal would act on instead of showing: an escape sequence other than a colour, a
#: C0 control but tab and newline (a lone carriage return too), DEL, and C1 (``\x9b`` is CSI).
_CONTROL = re.compile(r"(\x1b\[[0-9;]*m)|\r\n|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _shown(match: re.Match[str]) -> str:
    if match.group(1) or match.group(0) == "\r\n":
        return match.group(0)  # a colour (kfp's own output) and a CRLF line end stay as they are
    return f"\\x{ord(match.group(0)):02x}"


def neutralize(text: str) -> str:
    r"""``text`` with every control a terminal acts on written out visibly (ESC as ``\x1b``).

    Pod logs and server answers reach the user's terminal: an escape sequence in them could
    retitle the window, clear the screen, move the cursor over earlier lines or hide text.
    """
    return _CONTROL.sub(_shown, text)


class RedactingStream(io.TextIOBase):
    """A text stream that redacts whole lines, their controls shown inertly, before passing them on.

    Text is held back until its line is complete, so a credential split over two writes is
    still seen whole; :meth:`flush` passes a partial line on (redacted) as it is.

    Args:
        inner: The stream written to (e.g. the original ``sys.stderr``).
    """

    #: A line longer than this is passed on in pieces (a stream must not hold unbounded text).
    MAX_PENDING = 1 << 16

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self._pending = ""
        self._wlock = threading.RLock()  # a signal handler may print while a write runs

    def write(self, text: str) -> int:
        """Queue ``text``; pass every complete line on, redacted."""
        with self._wlock:
            self._pending += text
            head, newline, rest = self._pending.rpartition("\n")
            if newline:
                self._pending = rest
                self.inner.write(neutralize(redact(head + newline)))
            if len(self._pending) > self.MAX_PENDING:
                self.inner.write(neutralize(redact(self._pending)))
                self._pending = ""
        return len(text)

    def flush(self) -> None:
        """Pass a partial line on (redacted) and flush the inner stream."""
        with self._wlock:
            if self._pending:
                self.inner.write(neutralize(redact(self._pending)))
                self._pending = ""
        self.inner.flush()

    def writable(self) -> bool:
        """Always: it is an output stream."""
        return True

    def isatty(self) -> bool:
        """Whether the inner stream is a terminal."""
        return bool(getattr(self.inner, "isatty", lambda: False)())

    def fileno(self) -> int:
        """The inner stream's descriptor."""
        return self.inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The inner stream's encoding."""
        return getattr(self.inner, "encoding", "utf-8")


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """Pass every line of stdout and stderr through :func:`redact` inside the ``with`` block.

    Whatever prints there (our messages, an API server's error body, pod logs, a library's
    warning), no registered credential reaches the terminal or the KFP task log.
    """
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(saved[0]), RedactingStream(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
