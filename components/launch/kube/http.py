"""Every Kubernetes API call bounded in time and size, never redirected, stoppable by a signal.

The ``kubernetes`` client sends each request through urllib3 with what urllib3 does by default,
and a hostile or broken server (or whatever stands in front of it) could use each of those:

* a 429 or 503 with ``Retry-After: 3600`` made urllib3 sleep an hour *inside* the call, deaf to
  SIGTERM (the launcher's handler only sets a flag), so a cancelled job was never deleted;
* the ``(connect, read)`` timeout bounds one socket read, not the call: a server trickling a byte
  every 59 s held the launcher forever;
* a body was read whole into memory (5.8 GB), and a streamed log line without a newline grew
  without end (930 MB);
* a 3xx was followed, a 307/308 re-sending the job's POST body to wherever it pointed.

:func:`bound` swaps an ``ApiClient``'s pool manager for :class:`BoundedPool`, which sends every
request with urllib3's retries off (except a few connection attempts), redirects refused and
Retry-After ignored, and reads it under a :class:`_Guard`: a timer that shuts the call's socket
down once :data:`CALL_DEADLINE_S` has passed, or at once when :func:`interrupt_calls` is called
(from a SIGTERM handler: the blocked read returns, the launcher goes on to delete its job). A
body is read up to :data:`MAX_BODY_BYTES`; a stream (logs, watches) is passed on with every line
cut at :data:`MAX_LINE_BYTES`. A 429 is retried by :mod:`.calls` with :func:`pause`, which a
signal cuts short too. This module imports nothing of ours, so :mod:`.calls` can import it.
"""

from __future__ import annotations

import io
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from urllib3 import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.response import HTTPResponse
from urllib3.util.retry import Retry
from urllib3.util.timeout import Timeout

#: Seconds one call may take in all: connecting, sending, the headers and the whole body.
CALL_DEADLINE_S = 120.0
#: Seconds a stopped launcher has, from its stop signal, for everything it still does (the job's
#: delete, its retries and the wait for it to be gone), all of it together: below KFP's 30 s
#: termination grace, after which the step's pod is SIGKILLed with the job left behind.
STOP_BUDGET_S = 25.0
#: Largest body read into memory (a list of a big namespace's pods is a few MiB).
MAX_BODY_BYTES = 64 << 20
#: Longest line of a streamed response passed on whole (an object the API serves is < 1.5 MiB).
MAX_LINE_BYTES = 2 << 20
#: What replaces the rest of a streamed line longer than :data:`MAX_LINE_BYTES`.
CUT_MARK = b" [kfp-nvrx: the rest of this line was dropped, longer than 2 MiB]"
_CHUNK = 64 << 10
#: Connection attempts only: a sent request is never re-sent, a status never retried here.
_RETRIES = Retry(total=2, connect=2, read=0, redirect=False, status=0, other=0,
                 respect_retry_after_header=False, raise_on_status=False)
#: A stopped launcher's calls: one connection attempt (a refused connect must not eat the budget).
_STOP_RETRIES = Retry(total=0, connect=0, read=0, redirect=False, status=0, other=0,
                      respect_retry_after_header=False, raise_on_status=False)


class CallLimit(Exception):  # noqa: N818 - the message says what limit
    """A call went past a bound (:data:`CALL_DEADLINE_S`, :data:`MAX_BODY_BYTES`)."""


class CallInterrupted(Exception):  # noqa: N818 - it is what happened
    """The call was cut short by :func:`interrupt_calls` (a stop signal)."""


_local = threading.local()
_active: dict[int, _Guard] = {}  # in-flight guarded calls (dict ops are atomic under the GIL)
_interrupts = [0]  # times interrupt_calls() ran: a pause that sees it change stops
_stop_by = [0.0]  # time.monotonic() by which a stopped launcher's calls end (0: not stopped)


def start_stop_clock(budget_s: float = STOP_BUDGET_S) -> None:
    """From now on every call and pause ends within ``budget_s`` in all (signal-handler safe)."""
    if not _stop_by[0]:
        _stop_by[0] = time.monotonic() + budget_s


def reset_stop_clock() -> None:
    """No stop is under way (a new launch in this process)."""
    _stop_by[0] = 0.0


def stop_left() -> float | None:
    """Seconds left of the stop's budget; None when no stop signal came."""
    return None if not _stop_by[0] else max(0.0, _stop_by[0] - time.monotonic())


def _shutdown(sock: Any) -> None:
    """Ends every blocked read on ``sock`` now (the plain socket's call, under TLS too)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, TypeError, ValueError):
        pass  # already closed


class _Guard:
    """The bounds of one call: its connections are shut down at the deadline or on interrupt.

    Takes no lock: :meth:`interrupt` runs in a signal handler, which may run while the thread
    it interrupted holds any lock.
    """

    def __init__(self, deadline_s: float) -> None:
        self.conns: list[Any] = []
        self.expired = self.interrupted = False
        self.deadline_s = deadline_s
        self._timer = threading.Timer(deadline_s, self._expire)
        self._timer.daemon = True

    def watch(self, conn: Any) -> None:
        """Bounds ``conn`` by this call (at once when the call is already over its bounds)."""
        self.conns.append(conn)
        if self.expired or self.interrupted:
            _shutdown(getattr(conn, "sock", None))

    def _trip(self) -> None:
        for conn in list(self.conns):
            _shutdown(getattr(conn, "sock", None))

    def _expire(self) -> None:
        self.expired = True
        self._trip()

    def interrupt(self) -> None:
        """Cuts the call short (signal-handler safe)."""
        self.interrupted = True
        self._trip()

    def __enter__(self) -> _Guard:
        _local.guard = self
        _active[id(self)] = self
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        _active.pop(id(self), None)
        _local.guard = None

    def check(self, err: BaseException | None = None) -> None:
        """Raises what ended the call when it was one of its bounds."""
        if self.interrupted:
            raise CallInterrupted("interrupted by a stop signal") from err
        if self.expired:
            within = (f"the {STOP_BUDGET_S:g} s a stopped launcher has" if
                      self.deadline_s < CALL_DEADLINE_S else f"{CALL_DEADLINE_S:g} s")
            raise CallLimit(f"gave no complete answer within {within} (a server that answers "
                            "too slowly, or a proxy holding the connection)") from err


def interrupt_calls() -> None:
    """Cuts short every API call and :func:`pause` in flight; later calls are not affected.

    Safe in a signal handler (no lock is taken).
    """
    _interrupts[0] += 1
    for guard in list(_active.values()):
        guard.interrupt()


def pause(seconds: float) -> None:
    """Sleeps ``seconds`` unless :func:`interrupt_calls` runs meanwhile.

    Raises:
        CallInterrupted: It did.
    """
    left = stop_left()
    seen, end = _interrupts[0], time.monotonic() + (seconds if left is None else
                                                      min(seconds, left))
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))
        if _interrupts[0] != seen:
            raise CallInterrupted("interrupted by a stop signal")


class StopSignals:
    """SIGTERM/SIGINT -> an Event, while inside the ``with`` block (main thread only).

    The signal also cuts short every API call in flight (:func:`interrupt_calls`): the thread
    it interrupted goes on to act on the event (delete the job) instead of waiting on a server.
    """

    def __init__(self, enabled: bool) -> None:
        self.event = threading.Event()
        self.signum = 0
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        start_stop_clock()  # FT: what the launcher still does ends within STOP_BUDGET_S
        self.event.set()
        interrupt_calls()  # a call blocked on the API server returns now

    def __enter__(self) -> StopSignals:
        reset_stop_clock()
        if self._enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Watched:
    """Registers the connection with the calling thread's guard whenever it is used."""

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._watch()

    def request(self, *args: Any, **kwargs: Any) -> None:
        self._watch()
        super().request(*args, **kwargs)  # type: ignore[misc]

    def _watch(self) -> None:
        guard = getattr(_local, "guard", None)
        if guard is not None and self not in guard.conns:
            guard.watch(self)


class _HTTPConnection(_Watched, HTTPConnection):
    pass


class _HTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


def _read_body(resp: HTTPResponse, guard: _Guard) -> bytes:
    """The whole body, at most :data:`MAX_BODY_BYTES` (decoded: a gzip bomb counts unpacked)."""
    data, total = bytearray(), 0
    try:
        for chunk in resp.stream(_CHUNK, decode_content=True):
            total += len(chunk)
            if total > MAX_BODY_BYTES:
                raise CallLimit(f"answered with more than {MAX_BODY_BYTES >> 20} MiB; nothing "
                                "the launcher asks for is that large")
            data += chunk
    except CallLimit:
        resp.close()
        raise
    except Exception as err:
        resp.close()
        guard.check(err)
        raise
    guard.check()
    resp.release_conn()
    return bytes(data)


def cut_lines(chunks: Iterator[bytes], limit: int | None = None) -> Iterator[bytes]:
    """``chunks`` with every line longer than ``limit`` cut there (:data:`CUT_MARK` appended).

    ``limit`` defaults to :data:`MAX_LINE_BYTES`.
    """
    limit = MAX_LINE_BYTES if limit is None else limit
    run, dropping = 0, False
    for chunk in chunks:
        out = bytearray()
        pieces = chunk.split(b"\n")
        for i, piece in enumerate(pieces):
            if not dropping:
                keep = piece[:max(0, limit - run)]
                out += keep
                run += len(keep)
                if len(keep) < len(piece):
                    out += CUT_MARK + b"\n"
                    dropping = True
            if i < len(pieces) - 1:  # a newline ends this piece
                if not dropping:
                    out += b"\n"
                run, dropping = 0, False
        if out:
            yield bytes(out)


class BoundedStream:
    """A streamed response whose reads come in bounded pieces, every line cut at a bound."""

    def __init__(self, resp: HTTPResponse) -> None:
        self._resp = resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resp, name)

    def stream(self, amt: int | None = None, decode_content: bool | None = None
               ) -> Iterator[bytes]:
        """The body in pieces of at most 64 KiB (``amt=None`` read it whole), lines cut."""
        return cut_lines(self._resp.stream(_CHUNK, decode_content=decode_content))

    def __iter__(self) -> Iterator[bytes]:
        return self.stream()


class BoundedPool:
    """Stands in for an ``ApiClient``'s urllib3 pool manager (``rest_client.pool_manager``).

    Args:
        inner: The pool manager the client made (its TLS and proxy settings are kept).
    """

    def __init__(self, inner: Any) -> None:
        inner.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        inner.clear()  # pools made before the swap would keep the plain connections
        self.inner = inner

    def request(self, method: str, url: str, *, preload_content: bool = True,
                **kwargs: Any) -> Any:
        """One request under a guard; a preloaded body (or an error's) is read bounded.

        Raises:
            CallLimit: The call went past a bound.
            CallInterrupted: :func:`interrupt_calls` cut it short.
        """
        kwargs.update(redirect=False, retries=_RETRIES)
        deadline_s, left = CALL_DEADLINE_S, stop_left()
        if left is not None:  # stopping: this call gets what is left of the stop's budget
            if left <= 0:
                raise CallLimit(f"not sent: the {STOP_BUDGET_S:g} s a stopped launcher has "
                                "are used up")
            deadline_s = min(deadline_s, left)
            kwargs.update(retries=_STOP_RETRIES, timeout=Timeout(connect=left, read=left))
        with _Guard(deadline_s) as guard:
            try:
                resp = self.inner.request(method, url, preload_content=False, **kwargs)
            except Exception as err:
                guard.check(err)
                raise
            if not preload_content and 200 <= resp.status < 300:
                return BoundedStream(resp)  # a log or watch: long-lived, read by its caller
            body = _read_body(resp, guard)
        return HTTPResponse(body=io.BytesIO(body), headers=resp.headers, status=resp.status,
                            version=resp.version, reason=resp.reason, preload_content=True,
                            decode_content=False, request_method=method, request_url=url)

    def clear(self) -> None:
        """Closes the pooled connections."""
        self.inner.clear()


def bound(api_client: Any) -> Any:
    """Makes every call of ``api_client`` (a ``kubernetes.client.ApiClient``) bounded.

    Returns:
        ``api_client`` (once bounded, calling this again changes nothing).
    """
    rest = getattr(api_client, "rest_client", None)
    if rest is not None and not isinstance(rest.pool_manager, BoundedPool):
        rest.pool_manager = BoundedPool(rest.pool_manager)
    return api_client
