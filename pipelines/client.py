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
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.errors import UserError

#: Upper bound the KFP API server enforces on a recurring run's max_concurrency.
MAX_CONCURRENCY = 10
_AUTH_HINT = ("pass a bearer token with --token-file (e.g. a service-account token), or open the "
              "API through `kubectl port-forward` which needs no login")

# -- cron ------------------------------------------------------------------------------------

_CRON_FIELDS = (  # name, low, high, names
    ("seconds", 0, 59, None),
    ("minutes", 0, 59, None),
    ("hours", 0, 23, None),
    ("day-of-month", 1, 31, None),
    ("month", 1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT",
                      "NOV", "DEC")),
    ("day-of-week", 0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
_CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight",
                     "@hourly")
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
_CRON_EXAMPLE = "e.g. '0 0 3 * * *' for 03:00:00 every day"


def _cron_value(text: str, low: int, names: tuple[str, ...] | None, field: str) -> int:
    if names and text.upper() in names:
        return names.index(text.upper()) + (low if field == "month" else 0)
    if not text.isdigit():
        raise ValueError(f"{field} value {text!r} is not a number")
    return int(text)


def _check_cron_field(text: str, field: str, low: int, high: int,
                      names: tuple[str, ...] | None) -> None:
    for part in text.split(","):
        base, _, step = part.partition("/")
        if step and (not step.isdigit() or int(step) < 1):
            raise ValueError(f"{field} step {step!r} must be a whole number >= 1")
        if base in ("*", "?"):
            if base == "?" and field not in ("day-of-month", "day-of-week"):
                raise ValueError(f"'?' is allowed only in day-of-month and day-of-week, "
                                 f"not in {field}")
            continue
        first, _, last = base.partition("-")
        lo = _cron_value(first, low, names, field)
        hi = _cron_value(last, low, names, field) if last else lo
        for v in (lo, hi):
            if not low <= v <= high:
                raise ValueError(f"{field} value {v} is outside {low}-{high}")
        if lo > hi:
            raise ValueError(f"{field} range {base!r} runs backwards")


def validate_cron(expr: str) -> str:
    """Check a KFP cron expression: 6 fields, seconds first (robfig/cron syntax).

    Also accepts the descriptors ``@daily`` etc. and ``@every <duration>``.

    Args:
        expr: The expression as typed.

    Returns:
        The expression with surrounding/duplicate whitespace removed.

    Raises:
        UserError: Naming ``--cron``, what is wrong and an example.

    """
    parts = (expr or "").split()
    text = " ".join(parts)
    if text.startswith("@"):
        if text in _CRON_DESCRIPTORS:
            return text
        if len(parts) == 2 and parts[0] == "@every" and _GO_DURATION.match(parts[1]):
            return text
        raise UserError("--cron", f"unknown descriptor {text!r}; use one of "
                        f"{', '.join(_CRON_DESCRIPTORS)} or '@every 6h', or 6 fields, "
                        f"{_CRON_EXAMPLE}")
    if len(parts) != 6:
        hint = (" (that looks like 5-field Unix cron; KFP puts seconds first)"
                if len(parts) == 5 else "")
        raise UserError("--cron", f"expected 6 fields (seconds minutes hours day-of-month month "
                        f"day-of-week), got {len(parts)} in {text!r}{hint}; {_CRON_EXAMPLE}")
    for part, (field, low, high, names) in zip(parts, _CRON_FIELDS, strict=True):
        bare = part.upper()
        for name in names or ():
            bare = bare.replace(name, "")
        if re.search(r"[LW#]", bare):
            raise UserError("--cron", f"{field} {part!r}: L, W and # are Quartz extensions that "
                            f"KFP does not support; {_CRON_EXAMPLE}")
        try:
            _check_cron_field(part, field, low, high, names)
        except ValueError as err:
            raise UserError("--cron", f"{err} in {text!r}; {_CRON_EXAMPLE}") from None
    return text


# -- pipeline parameters ---------------------------------------------------------------------

def load_package(path: str | Path) -> dict[str, Any]:
    """Read a compiled pipeline YAML (the first document: the pipeline spec)."""
    try:
        with open(path, encoding="utf-8") as f:
            docs = list(yaml.safe_load_all(f))
    except OSError as err:
        raise UserError("--package", f"cannot read {path}: {err.strerror or err}") from None
    except yaml.YAMLError:
        raise UserError("--package", f"{path} is not valid YAML") from None
    if not docs or not isinstance(docs[0], dict) or "root" not in docs[0]:
        raise UserError("--package", f"{path} is not a compiled KFP pipeline (no 'root')")
    return docs[0]


def pipeline_parameters(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return the pipeline's input parameters: name -> ``{parameterType, defaultValue?, ...}``."""
    return dict(spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {}))


def _convert(name: str, raw: str, ptype: str) -> Any:
    field = f"--param {name}"
    if ptype == "STRING":
        return raw
    if ptype == "NUMBER_INTEGER":
        try:
            return int(raw)
        except ValueError:
            raise UserError(field, f"expected an integer, got {raw!r}") from None
    if ptype == "NUMBER_DOUBLE":
        try:
            return float(raw)
        except ValueError:
            raise UserError(field, f"expected a number, got {raw!r}") from None
    if ptype == "BOOLEAN":
        low = raw.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise UserError(field, f"expected true or false, got {raw!r}")
    if ptype == "LIST":
        if not raw.strip().startswith("["):
            return [item.strip() for item in raw.split(",") if item.strip()]
        value = _json(field, raw)
        if not isinstance(value, list):
            raise UserError(field, f"expected a JSON list or comma-separated items, got {raw!r}")
        return value
    if ptype == "STRUCT":
        value = _json(field, raw)
        if not isinstance(value, dict):
            raise UserError(field, f"expected a JSON object, got {raw!r}")
        return value
    return raw


def _json(field: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise UserError(field, f"is not valid JSON ({err.msg} at column {err.colno})") from None


def parse_params(items: list[str] | None, params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Turn ``--param name=value`` strings into typed pipeline arguments.

    Args:
        items: The raw ``name=value`` strings; later ones win.
        params: :func:`pipeline_parameters` of the target pipeline.

    Returns:
        Name -> value converted to the parameter's type (lists accept JSON or ``a,b``).

    Raises:
        UserError: For malformed items, unknown names or values of the wrong type.

    """
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError("--param", f"expected name=value, got {item!r}")
        if name not in params:
            raise UserError(f"--param {name}", "unknown parameter; known: "
                            f"{', '.join(sorted(params))}")
        out[name] = _convert(name, raw, params[name].get("parameterType", "STRING"))
    return out


# -- KFP API -----------------------------------------------------------------------------------

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
            body = resp.read()
    except urllib.error.HTTPError as err:
        if err.code in (301, 302, 303, 307, 308):
            where = err.headers.get("Location", "a login page")
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
        reason = getattr(err, "reason", err)
        raise UserError("--host", f"cannot reach {host} ({reason}); check the URL, or forward "
                        "the API: kubectl -n kubeflow port-forward svc/ml-pipeline-ui "
                        "8080:80") from None
    try:
        json.loads(body or b"{}")
    except json.JSONDecodeError:
        raise UserError("--host", f"{host} did not answer like a KFP API (healthz is not JSON); "
                        "give the pipelines API/UI base URL") from None


def api_error(host: str, err: Exception) -> UserError:
    """Fold an exception from a ``kfp.Client`` call into one line naming ``--host``."""
    status = getattr(err, "status", None)
    if status in (401, 403):
        return UserError("--host", f"the KFP API at {host} refused the request (HTTP {status}); "
                         f"{_AUTH_HINT}")
    if status:
        detail = ""
        body = getattr(err, "body", None)
        if body:
            try:
                parsed = json.loads(body)
                detail = parsed.get("message") or parsed.get("error") or ""
            except (ValueError, AttributeError):
                detail = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
        detail = " ".join(str(detail).split())[:300]
        return UserError("--host", f"the KFP API at {host} answered HTTP {status}"
                         f"{': ' + detail if detail else ''}")
    return UserError("--host", f"request to {host} failed: {' '.join(str(err).split())[:300]}")


def normalize_host(host: str) -> str:
    """Validate ``--host`` (an http(s) URL) and drop a trailing slash."""
    host = (host or "").strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", host):
        raise UserError("--host", f"expected an http(s) URL such as http://localhost:8080, "
                        f"got {host!r}")
    return host


def read_token(token_file: str | None) -> str | None:
    """Read a bearer token from a file (None when no file was given)."""
    if not token_file:
        return None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise UserError("--token-file", f"cannot read {token_file}: {err.strerror}") from None
    if not token:
        raise UserError("--token-file", f"{token_file} is empty")
    return token


def connect(host: str, *, token: str | None = None, namespace: str | None = None,
            timeout: float = 10.0) -> Any:
    """Probe the host, then return a ``kfp.Client`` for it.

    Args:
        host: Base URL of the KFP API (e.g. a port-forward, http://localhost:8080).
        token: Bearer token, if the endpoint needs one.
        namespace: Kubeflow profile namespace (multi-user installs).
        timeout: Seconds the probe may take.

    Returns:
        A connected ``kfp.Client``.

    Raises:
        UserError: When the host is unreachable, not a KFP API, or authentication fails.

    """
    import kfp

    host = normalize_host(host)
    _probe(host, token, timeout)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return kfp.Client(host=host, existing_token=token, namespace=namespace or "kubeflow")
        except Exception as err:  # the client wraps urllib3/ApiException errors unevenly
            raise api_error(host, err) from None


def _call(host: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one client call with its prints captured and its errors folded into one line."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as err:
        raise api_error(host, err) from None


def submit(client: Any, host: str, package: str | Path, *, arguments: dict[str, Any],
           experiment: str, run_name: str, namespace: str | None = None) -> dict[str, str]:
    """Create (or reuse) the experiment and start one run of a compiled pipeline.

    Args:
        client: From :func:`connect`.
        host: The base URL (for messages and the run link).
        package: Compiled pipeline YAML.
        arguments: Typed pipeline arguments (:func:`parse_params`).
        experiment: Experiment name; created when missing.
        run_name: Display name of the run.
        namespace: Kubeflow profile namespace (multi-user installs).

    Returns:
        ``run_id``, ``experiment_id`` and ``url`` of the run.

    """
    exp = _call(host, client.create_experiment, name=experiment, namespace=namespace)
    run = _call(host, client.run_pipeline, experiment_id=exp.experiment_id, job_name=run_name,
                pipeline_package_path=str(package), params=arguments)
    return {"run_id": run.run_id, "experiment_id": exp.experiment_id,
            "url": f"{host}/#/runs/details/{run.run_id}"}


def schedule(client: Any, host: str, package: str | Path, *, cron: str, max_concurrency: int,
             no_catchup: bool, arguments: dict[str, Any], experiment: str, name: str,
             namespace: str | None = None) -> dict[str, str]:
    """Create a recurring run of a compiled pipeline on a cron schedule.

    Args:
        client: From :func:`connect`.
        host: The base URL (for messages and the link).
        package: Compiled pipeline YAML.
        cron: 6-field cron, seconds first (checked with :func:`validate_cron`).
        max_concurrency: Runs of this schedule allowed at once (1-10).
        no_catchup: Skip missed intervals instead of back-filling them.
        arguments: Typed pipeline arguments (:func:`parse_params`).
        experiment: Experiment name; created when missing.
        name: Display name of the recurring run.
        namespace: Kubeflow profile namespace (multi-user installs).

    Returns:
        ``recurring_run_id``, ``experiment_id`` and ``url``.

    """
    cron = validate_cron(cron)
    if not 1 <= int(max_concurrency) <= MAX_CONCURRENCY:
        raise UserError("--max-concurrency", f"must be within 1-{MAX_CONCURRENCY}, "
                        f"got {max_concurrency}")
    exp = _call(host, client.create_experiment, name=experiment, namespace=namespace)
    rec = _call(host, client.create_recurring_run, experiment_id=exp.experiment_id,
                job_name=name, cron_expression=cron, max_concurrency=int(max_concurrency),
                no_catchup=bool(no_catchup), params=arguments,
                pipeline_package_path=str(package))
    return {"recurring_run_id": rec.recurring_run_id, "experiment_id": exp.experiment_id,
            "url": f"{host}/#/recurringrun/details/{rec.recurring_run_id}"}
