"""Submit and schedule compiled pipelines on a Kubeflow Pipelines API with ``kfp.Client``.

Everything the user types is checked before the first request: pipeline name, ``--param`` names
and types (against the compiled pipeline's inputs), the 6-field cron expression and the
concurrency. The host is probed once (``GET /apis/v2beta1/healthz``, redirects not followed) so an
unreachable host or a failed login becomes one line naming ``--host`` instead of a retry loop and
a traceback; API refusals later on are folded into one line the same way.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3.util

from kfp_nvrx.components.core.bounded import TOKEN_LIMIT, read_bytes
from kfp_nvrx.components.errors import UserError, redact
from kfp_nvrx.components.redaction import register as register_secret
from kfp_nvrx.pipelines.cron import validate_cron

__all__ = ["validate_cron"]  # re-exported: submit/schedule check the cron through this module

#: Upper bound the KFP API server enforces on a recurring run's max_concurrency.
MAX_CONCURRENCY = 10
#: ``http(s)://user[:password]@``: credentials typed into the URL.
_USERINFO_IN_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*@")
#: What a bearer token may consist of (visible ASCII: an HTTP header value without spaces).
_TOKEN = re.compile(r"[\x21-\x7e]+")
#: Seconds one API call may take after the health probe (a stalled API must not hang us).
API_TIMEOUT = 60.0
_AUTH_HINT = ("pass a bearer token with --token-file (e.g. a service-account token), or open the "
              "API through `kubectl port-forward` which needs no login")

def _probe(host: str, token: str | None, timeout: float) -> None:
    """One healthz request; raises UserError when the host is unreachable or refuses us."""

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    req = urllib.request.Request(f"{host}/apis/v2beta1/healthz")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=timeout) as resp:
            body = resp.read(64 * 1024)  # bounded: more is no healthz (the JSON check fails)
    except urllib.error.HTTPError as err:
        if err.code in (301, 302, 303, 307, 308):
            where = redact(" ".join(err.headers.get("Location", "a login page").split()),
                           [token or ""])[:300]
            raise UserError("--host", f"{host} redirected to {where} (login required); "
                            f"{_AUTH_HINT}") from None
        if err.code in (401, 403):
            raise UserError("--host", f"authentication failed at {host} (HTTP {err.code}); "
                            f"{_AUTH_HINT}") from None
        if err.code == 404:
            raise UserError("--host", f"no KFP v2beta1 API at {host} (HTTP 404); give the "
                            "pipelines API/UI base URL, e.g. http://localhost:8080") from None
        raise UserError("--host", f"{host} answered HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = redact(" ".join(str(getattr(err, "reason", err)).split()), [token or ""])
        raise UserError("--host", f"cannot reach {host} ({reason}); check the URL, or forward "
                        "the API: kubectl -n kubeflow port-forward svc/ml-pipeline-ui "
                        "8080:80") from None
    try:
        json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError("--host", f"{host} did not answer like a KFP API (healthz is not JSON); "
                        "give the pipelines API/UI base URL") from None


#: Connection attempts only; a status (429, 503) and a redirect come back to the caller.
_NO_STATUS_RETRIES = urllib3.util.Retry(total=2, connect=2, read=0, redirect=False, status=0,
                                        other=0, respect_retry_after_header=False,
                                        raise_on_status=False)


def _refuse_redirects(client: Any, seen: list[tuple[str, str, str]]) -> None:
    """Make every request of ``client`` hand a 3xx back instead of following it.

    urllib3 (under ``kfp.Client``) follows 301/302/307/308 by re-sending the request, POST body
    included, to wherever ``Location`` points; an auth proxy or a hostile server could collect
    pipeline specs and parameters that way. Each refused redirect is recorded in ``seen`` as
    (method, request URL, absolute Location) for the error message.
    """
    pool = client._run_api.api_client.rest_client.pool_manager  # shared by every generated API
    follow = pool.urlopen

    def urlopen(method: str, url: str, redirect: bool = True, **kw: Any) -> Any:
        # A 429's Retry-After is not slept on inside the call either: it outlasted --timeout
        # and read "did not answer"; the 429 itself comes back and says what it is.
        kw["retries"] = _NO_STATUS_RETRIES
        resp = follow(method, url, redirect=False, **kw)
        if 300 <= resp.status < 400:
            seen.append((method, url, urllib.parse.urljoin(url, resp.headers.get("Location")
                                                           or "")))
        return resp

    pool.urlopen = urlopen


def api_error(host: str, err: Exception, secrets: tuple[str, ...] = (),
              redirects: list[tuple[str, str, str]] | None = None) -> UserError:
    """Fold an exception from a ``kfp.Client`` call into one line naming ``--host``.

    ``secrets`` (the bearer token) are cut out of whatever the server or the client library said;
    ``redirects`` are the ones :func:`_refuse_redirects` refused.
    """
    status = getattr(err, "status", None)
    if isinstance(status, int) and 300 <= status < 400:
        method, url, where = (redirects or [("a", host, "")])[-1]
        path = urllib.parse.urlsplit(url).path or "/"
        where = redact(" ".join(where.split()), secrets)[:300] or "nowhere (no Location)"
        return UserError("--host", f"the KFP API at {host} answered {method} {path} with HTTP "
                         f"{status}, redirecting to {where}; not followed: it would re-send the "
                         "request and its body there. Give the API's final URL as --host")
    if status in (401, 403):
        return UserError("--host", f"the KFP API at {host} refused the request (HTTP {status}); "
                         f"{_AUTH_HINT}")
    if status == 429:
        headers = getattr(err, "headers", None) or {}
        wait = " ".join(str(headers.get("Retry-After") or "").split())[:40]
        return UserError("--host", f"the KFP API at {host} is throttling requests (HTTP 429"
                         f"{', Retry-After ' + wait + ' s' if wait else ''}); nothing was done, "
                         "try again later")
    if status:
        detail = ""
        body = getattr(err, "body", None)
        if body:
            try:
                parsed = json.loads(body)
                detail = parsed.get("message") or parsed.get("error") or ""
            except (ValueError, AttributeError):
                detail = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
        detail = redact(" ".join(str(detail).split()), secrets)[:300]
        return UserError("--host", f"the KFP API at {host} answered HTTP {status}"
                         f"{': ' + detail if detail else ''}")
    detail = redact(" ".join(str(err).split()), secrets)[:300]
    return UserError("--host", f"request to {host} failed: {detail}")


def normalize_host(host: str) -> str:
    """Validate ``--host`` (an http(s) URL without credentials) and drop a trailing slash."""
    host = (host or "").strip().rstrip("/")
    if _USERINFO_IN_URL.match(host):
        # Never echo the value: it holds a password.
        raise UserError("--host", "user:password in the URL is not accepted (it would end up in "
                        "logs and error messages); give the bare URL and a bearer token with "
                        "--token-file")
    if any(ch.isspace() or not ch.isprintable() for ch in host):
        raise UserError("--host", f"contains whitespace or a control character: {host!r}; give "
                        "one URL such as http://localhost:8080")
    if not re.match(r"^https?://[^/\s]+", host):
        raise UserError("--host", f"expected an http(s) URL such as http://localhost:8080, "
                        f"got {host!r}")
    try:  # what urllib and urllib3 parse it with later: a bad port or IPv6 literal fails here
        parts = urllib.parse.urlsplit(host)
        _ = parts.port
    except ValueError as err:
        raise UserError("--host", f"is not a valid URL ({err}): {host!r}; give one URL such as "
                        "http://localhost:8080") from None
    if not parts.hostname:
        raise UserError("--host", f"names no host: {host!r}; give one URL such as "
                        "http://localhost:8080")
    return host


def read_token(token_file: str | None) -> str | None:
    """Read a bearer token from a file (None when no file was given).

    The token must be one line of printable ASCII (what an HTTP header can carry). Errors name
    the file and what is wrong, never any of its content.
    """
    if not token_file:
        return None
    raw = read_bytes(token_file, "--token-file", TOKEN_LIMIT, "token file")  # no /dev/zero, FIFO
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError("--token-file", f"{token_file} is not a text file; it must hold the "
                        "token on one line") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError("--token-file", f"{token_file} is empty")
    if len(lines) > 1:
        raise UserError("--token-file", f"{token_file} holds {len(lines)} non-empty lines; it "
                        "must hold only the token, on one line")
    if not _TOKEN.fullmatch(lines[0]):
        raise UserError("--token-file", f"{token_file}: the token holds a space, a control or a "
                        "non-ASCII character; it must be one word of printable ASCII")
    register_secret(lines[0])  # cut out of everything printed from here on
    return lines[0]


class KfpApi:
    """A ``kfp.Client`` whose every call is bounded in time and folded into one safe line.

    Args:
        host: Base URL of the KFP API (checked by :func:`normalize_host`).
        token: Bearer token, if the endpoint needs one; never printed.
        namespace: Kubeflow profile namespace (multi-user installs): the client's, and the one
            experiments and runs are created in.
        timeout: Seconds the probe and each later API call may take.

    Raises:
        UserError: When the host is unreachable, not a KFP API, or authentication fails.

    """

    def __init__(self, host: str, *, token: str | None = None, namespace: str | None = None,
                 timeout: float = API_TIMEOUT) -> None:
        import kfp

        self.host = normalize_host(host)
        self.namespace = namespace
        self.timeout = float(timeout)
        self._secrets = (token,) if token else ()
        self._redirects: list[tuple[str, str, str]] = []
        _probe(self.host, token, self.timeout)
        self.client = self.call(kfp.Client, host=self.host, existing_token=token,
                                namespace=namespace or "kubeflow")
        _refuse_redirects(self.client, self._redirects)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one client call with its prints captured, a deadline, and errors as one line.

        The call runs in a daemon thread: ``kfp.Client`` sets no socket timeout, so a stalled
        API would otherwise hang the command forever.
        """
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = err

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            worker = threading.Thread(target=target, daemon=True)
            worker.start()
            worker.join(self.timeout)
        if worker.is_alive():
            raise UserError("--host", f"the KFP API at {self.host} did not answer within "
                            f"{self.timeout:g}s (--timeout); it may have created the object "
                            "anyway: check the KFP UI before retrying")
        err = box.get("error")
        if isinstance(err, UserError):
            raise err
        if err is not None:
            raise api_error(self.host, err, self._secrets, self._redirects) from None
        return box["value"]


def _require_id(host: str, obj: Any, attr: str, what: str) -> str:
    value = getattr(obj, attr, None)
    if not isinstance(value, str) or not value:
        raise UserError("--host", f"the KFP API at {host} answered without a {what} id; the "
                        f"{what} may or may not exist: check the KFP UI")
    return value


def submit(api: KfpApi, package: str | Path, *, arguments: dict[str, Any], experiment: str,
           run_name: str) -> dict[str, str]:
    """Create (or reuse) the experiment and start one run of a compiled pipeline.

    Args:
        api: The connected API.
        package: Compiled pipeline YAML.
        arguments: Typed pipeline arguments (:func:`.params.parse_params`).
        experiment: Experiment name; created when missing.
        run_name: Display name of the run.

    Returns:
        ``run_id``, ``experiment_id`` and ``url`` of the run.

    Raises:
        UserError: On refusals, a timeout, or a reply without an id.

    """
    exp = api.call(api.client.create_experiment, name=experiment, namespace=api.namespace)
    exp_id = _require_id(api.host, exp, "experiment_id", "experiment")
    run = api.call(api.client.run_pipeline, experiment_id=exp_id, job_name=run_name,
                   pipeline_package_path=str(package), params=arguments)
    run_id = _require_id(api.host, run, "run_id", "run")
    return {"run_id": run_id, "experiment_id": exp_id,
            "url": f"{api.host}/#/runs/details/{run_id}"}


@dataclass(frozen=True)
class Recurrence:
    """When a recurring run starts its runs.

    Attributes:
        cron: 6-field cron, seconds first (checked with :func:`validate_cron`).
        max_concurrency: Runs of this schedule allowed at once (1-10).
        no_catchup: Skip missed intervals instead of back-filling them.
    """

    cron: str
    max_concurrency: int = 1
    no_catchup: bool = False


def schedule(api: KfpApi, package: str | Path, recurrence: Recurrence, *,
             arguments: dict[str, Any], experiment: str, name: str) -> dict[str, str]:
    """Create a recurring run of a compiled pipeline on a cron schedule.

    Args:
        api: The connected API.
        package: Compiled pipeline YAML.
        recurrence: The cron schedule, its concurrency and catch-up.
        arguments: Typed pipeline arguments (:func:`.params.parse_params`).
        experiment: Experiment name; created when missing.
        name: Display name of the recurring run.

    Returns:
        ``recurring_run_id``, ``experiment_id`` and ``url``.

    """
    cron, max_concurrency = validate_cron(recurrence.cron), recurrence.max_concurrency
    if not 1 <= int(max_concurrency) <= MAX_CONCURRENCY:
        raise UserError("--max-concurrency", f"must be within 1-{MAX_CONCURRENCY}, "
                        f"got {max_concurrency}")
    exp = api.call(api.client.create_experiment, name=experiment, namespace=api.namespace)
    exp_id = _require_id(api.host, exp, "experiment_id", "experiment")
    rec = api.call(api.client.create_recurring_run, experiment_id=exp_id, job_name=name,
                   cron_expression=cron, max_concurrency=int(max_concurrency),
                   no_catchup=bool(recurrence.no_catchup), params=arguments,
                   pipeline_package_path=str(package))
    rec_id = _require_id(api.host, rec, "recurring_run_id", "recurring run")
    return {"recurring_run_id": rec_id, "experiment_id": exp_id,
            "url": f"{api.host}/#/recurringrun/details/{rec_id}"}
