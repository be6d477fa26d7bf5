"""Calls to a Kubernetes API server that fail in one line naming the server, never a traceback.

What can stand between the launcher and the API server in a real cluster, and what each does to
the ``kubernetes`` client unless handled here:

* nothing listening / DNS / a firewall: urllib3 retries three times, logging a ``WARNING Retrying
  (Retry(total=2...))`` line per retry, then raises ``MaxRetryError`` with the connection's
  object repr in its text;
* a proxy or SSO gateway answering with its HTML login page (often as a 200 after a redirect): the
  client returns the page as a ``str`` where a dict was expected, and the caller crashes later;
* an answer that is not UTF-8 (a binary page, a wrong port speaking another protocol): the client
  raises ``UnicodeDecodeError`` while decoding it, for any status;
* TLS failures: ``ApiException(status=0)`` with a multi-line reason.

:func:`describe` turns each into one line; :func:`expect_object` refuses an answer that is not a
Kubernetes object; :func:`configure` silences urllib3's retry warnings (our own loops retry and
say so once). Every client made here is bounded (:mod:`.http`: time, size, no redirects,
cut short by a stop signal); :func:`call` retries a 429 a few times, a short and interruptible
wait each, never the hour a ``Retry-After`` may ask for.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from typing import Any

from kubernetes.client.rest import ApiException

from kfp_nvrx.components.launch.kube import http

#: (connect, read) seconds of one call: a connection that a load balancer dropped without a
#: word must end in an error the loops retry, not block the launcher (and its SIGTERM) forever.
REQUEST_TIMEOUT = (10.0, 60.0)
#: Longest part of an API server's error body quoted in a message.
MAX_BODY = 400
_HTML = re.compile(r"<\s*(!doctype\s+html|html|head|body|title)\b", re.IGNORECASE)
_OBJ_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-f]+>:?\s*")
#: A generated pod name in an event message ('pods "job-node-0-0-t2jzt" is forbidden').
_POD_NAME = re.compile(r'pods "[^"]*"')


#: Times :func:`call` retries a 429 (Too Many Requests), and the longest wait before each.
THROTTLE_RETRIES = 3
THROTTLE_WAIT_MAX_S = 10.0


class ClusterError(RuntimeError):
    """The cluster refused or could not answer (RBAC, missing CRD, API server down)."""


class Interrupted(ClusterError):
    """A call cut short by a stop signal (:func:`.http.interrupt_calls`)."""


def configure(configuration: Any) -> Any:
    """Quiet urllib3's per-retry warnings for the calls made with ``configuration``.

    The warnings are not about anything the user can act on before the final error, which
    :func:`describe` reports in one line; every loop of ours that retries says so itself.

    Args:
        configuration: A ``kubernetes.client.Configuration`` (returned as is).

    Returns:
        ``configuration``.

    """
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    if getattr(configuration, "verify_ssl", True) is False:
        _say_insecure_once(str(getattr(configuration, "host", "") or "the API server"))
    return configuration


_insecure_said: set[str] = set()


def _say_insecure_once(host: str) -> None:
    """One line for a kubeconfig's ``insecure-skip-tls-verify``, not urllib3's two per call.

    urllib3 warns (``InsecureRequestWarning``, with its URL) on every request to an unverified
    HTTPS server: every poll of a long job printed two lines. The choice is the kubeconfig's;
    it is said once, and the warning category is silenced for this process.
    """
    import warnings

    from urllib3.exceptions import InsecureRequestWarning

    warnings.filterwarnings("ignore", category=InsecureRequestWarning)
    if host not in _insecure_said:
        _insecure_said.add(host)
        sys.stderr.write(f"warning: TLS certificates of {host} are not verified "
                         "(insecure-skip-tls-verify in the kubeconfig)\n")


def host_of(api_client: Any) -> str:
    """The server URL an ApiClient talks to ('the API server' when unknown)."""
    cfg = getattr(api_client, "configuration", None)
    return str(getattr(cfg, "host", "") or "the API server")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def looks_like_html(text: Any) -> bool:
    """True when ``text`` is (the start of) an HTML page."""
    return isinstance(text, str | bytes) and bool(
        _HTML.search(text[:2048] if isinstance(text, str) else text[:2048].decode("latin-1")))


def body_text(body: Any) -> str:
    """What an error body says, in at most :data:`MAX_BODY` characters on one line.

    A Kubernetes ``Status`` body is reduced to its ``message`` (what the server or an admission
    webhook says), not quoted as JSON.
    """
    if not body:
        return ""
    if looks_like_html(body):
        return "(an HTML page: a login page or a proxy in front of the API server?)"
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if isinstance(status, dict) and status.get("kind") == "Status" and status.get("message"):
        body = str(status["message"])
    return _one_line(body)[:MAX_BODY]


def _reason(err: BaseException) -> str:
    """The innermost useful text of a urllib3 connection error."""
    inner = getattr(err, "reason", None) or err
    return _OBJ_REPR.sub("", _one_line(str(inner))) or type(inner).__name__


def hints(crd: str) -> dict[int, str]:
    """Advice for the usual HTTP statuses of a call on ``crd``'s objects."""
    return {401: "The credentials were rejected.", 403: "RBAC forbids it (see docs/eks.md).",
            404: f"Is {crd} installed?"}


def describe(action: str, err: BaseException, host: str, hints: dict[int, str] | None = None
             ) -> ClusterError:
    """One line for a failed call.

    Args:
        action: What was being done ("reading PyTorchJob ns/name").
        err: What the client raised.
        host: The API server's URL.
        hints: Advice per HTTP status.

    Returns:
        The error to raise.

    """
    if isinstance(err, ClusterError):
        return err
    if isinstance(err, http.CallInterrupted):
        return Interrupted(f"{action}: {err}")
    if isinstance(err, http.CallLimit):
        return ClusterError(f"{action}: {host} {err}")
    if isinstance(err, ApiException) and 300 <= (err.status or 0) < 400:
        where = (err.headers or {}).get("Location") or "elsewhere"
        return ClusterError(f"{action}: {host} answered HTTP {err.status} {err.reason}, "
                            f"redirecting to {body_text(where)} (a login page or a proxy in "
                            "front of the API server?); redirects are not followed, a request "
                            "and its body go only to the kubeconfig's server")
    if isinstance(err, ApiException):
        if not err.status:  # the client's TLS failure (status 0, reason "SSLError\n...")
            return ClusterError(f"{action}: TLS with {host} failed: {_one_line(err.reason)}")
        said = body_text(err.body)
        # An admission webhook's refusal is a 403 too, but not RBAC's: the hint would mislead.
        hint = "" if "admission webhook" in said else (hints or {}).get(err.status, "")
        text = f"{action}: {host} answered HTTP {err.status} {err.reason}."
        return ClusterError(" ".join(p for p in (text, hint, said) if p))
    if isinstance(err, UnicodeDecodeError):
        return ClusterError(f"{action}: {host} answered with bytes that are not UTF-8: not a "
                            "Kubernetes API server (a proxy in the way, or the wrong port?)")
    if isinstance(err, OSError) or type(err).__module__.startswith("urllib3"):
        return ClusterError(f"{action}: cannot reach the Kubernetes API server at {host}: "
                            f"{_reason(err)}")
    return ClusterError(f"{action}: {type(err).__name__}: {_one_line(str(err))}")


def expect_object(resp: Any, action: str, host: str) -> dict[str, Any]:
    """Return ``resp`` if it is a Kubernetes object (a JSON object), else raise.

    Raises:
        ClusterError: An HTML page (login page, proxy) or anything else that is not JSON.

    """
    if isinstance(resp, dict):
        return resp
    if looks_like_html(resp):
        raise ClusterError(f"{action}: {host} answered with an HTML page, not the Kubernetes "
                           "API (a login page or a proxy? check the kubeconfig's server)")
    raise ClusterError(f"{action}: {host} answered with something that is not a Kubernetes "
                       f"object: {body_text(resp) or type(resp).__name__}")


def _retry_after(err: ApiException) -> float:
    """Seconds a 429 asks us to wait, capped at :data:`THROTTLE_WAIT_MAX_S` (1 s when unsaid)."""
    try:
        asked = float((err.headers or {}).get("Retry-After") or 1.0)
    except ValueError:  # an HTTP date, or nonsense: a second
        asked = 1.0
    return min(max(asked, 0.0), THROTTLE_WAIT_MAX_S) if math.isfinite(asked) else 1.0


def call(action: str, host: str, fn: Any, *args: Any, ok: tuple[int, ...] = (),
         hints: dict[int, str] | None = None, **kwargs: Any) -> Any:
    """Call ``fn``; an ``ApiException`` whose status is in ``ok`` is re-raised for the caller.

    A 429 (the API server's flow control) is retried :data:`THROTTLE_RETRIES` times; a request
    it answered so was not processed, so even a create is safe to send again.

    Returns:
        What ``fn`` returned.

    Raises:
        ApiException: The status is one of ``ok`` (404 on a read, 409 on a create).
        Interrupted: A stop signal cut the call (or its wait) short.
        ClusterError: Any other failure, in one line.

    """
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    for attempt in range(THROTTLE_RETRIES + 1):
        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            if err.status in ok:
                raise
            if err.status == 429 and attempt < THROTTLE_RETRIES:
                try:
                    http.pause(_retry_after(err))
                except http.CallInterrupted as stop:
                    raise describe(action, stop, host) from None
                continue
            raise describe(action, err, host, hints) from None
        except Exception as err:  # noqa: BLE001 - every other way a call fails: one line
            raise describe(action, err, host, hints) from None
    raise AssertionError("unreachable: the last attempt returns or raises")


def warning_events(core: Any, namespace: str, host: str, kind: str, name: str,
                   reason: str) -> list[str]:
    """Distinct messages of the Warning Events ``reason`` on object ``kind``/``name``.

    Generated pod names are cut out, so the Job controller's retries (a new name each time)
    read as one message.

    Raises:
        ClusterError: The events could not be read.

    """
    events = call(f"reading the events of {kind} {namespace}/{name}", host,
                  core.list_namespaced_event, namespace,
                  field_selector=f"involvedObject.kind={kind},involvedObject.name={name},"
                  f"reason={reason},type=Warning")
    out: list[str] = []
    for event in events.items:
        message = _POD_NAME.sub("pods", _one_line(event.message or ""))
        message = message.removeprefix("Error creating: ")[:MAX_BODY]
        if message and message not in out:
            out.append(message)
    return out
