"""``kfp-nvrx submit`` / ``schedule`` against a local TEST DOUBLE of the KFP v2beta1 API.

There is no KFP API server here; ``kfp_api_double.KfpApiDouble`` serves the few endpoints
``kfp.Client`` calls and records the requests, which these tests assert on.
"""

import json
import os
import subprocess
import sys

import pytest
from support.kfp_api_double import KfpApiDouble

from kfp_nvrx.components import __version__
from kfp_nvrx.components.cli.main import main
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.pipelines.client import validate_cron
from kfp_nvrx.pipelines.params import parse_params


@pytest.fixture(autouse=True)
def _no_kfp_context(tmp_path, monkeypatch):
    """Keep kfp.Client away from ~/.config/kfp/context.json and KF_PIPELINES_* settings."""
    from kfp.client import client as kfp_client

    monkeypatch.setattr(kfp_client.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "context.json"))
    for var in ("KFP_NVRX_REGISTRY", "KF_PIPELINES_ENDPOINT", "KF_PIPELINES_UI_ENDPOINT",
                "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME", "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture()
def api():
    with KfpApiDouble() as double:
        yield double


def _one_line_error(capsys, rc):
    out = capsys.readouterr()
    assert rc == 2, out
    err = out.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# -- submit -------------------------------------------------------------------------------------

def test_submit_creates_experiment_and_run_with_typed_params(api, capsys):
    rc = main(["submit", "--host", api.url, "--experiment", "exp1", "--run-name", "r1",
               "--param", "nodes=1", "--param", "faults=kill@5/1", "--param", "seq_len=32",
               "--param", "overrides=[\"train.steps=10\"]"])
    out = capsys.readouterr().out
    assert rc == 0
    listed = api.calls("GET", "/apis/v2beta1/experiments")
    assert listed and '"stringValue": "exp1"' in listed[0].query["filter"][0]
    created = api.calls("POST", "/apis/v2beta1/experiments")
    assert [c.body["display_name"] for c in created] == ["exp1"]
    (run,) = api.calls("POST", "/apis/v2beta1/runs")
    assert run.body["display_name"] == "r1"
    assert run.body["experiment_id"] == api.experiments[0]["experiment_id"]
    assert run.body["runtime_config"]["parameters"] == {
        "nodes": "1", "faults": ["kill@5/1"], "seq_len": 32, "overrides": ["train.steps=10"]}
    spec = run.body["pipeline_spec"]
    assert spec["pipeline_spec"]["pipelineInfo"]["name"] == "fsdp-train"
    execs = spec["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert "pvcMount" in execs["exec-train-fsdp"]
    assert "submitted fsdp-train run" in out and api.url + "/#/runs/details/" in out


def test_submit_reuses_existing_experiment(api, capsys):
    api.experiments.append({"experiment_id": "e-42", "display_name": "kfp-nvrx"})
    assert main(["submit", "--host", api.url]) == 0
    assert not api.calls("POST", "/apis/v2beta1/experiments")
    (run,) = api.calls("POST", "/apis/v2beta1/runs")
    assert run.body["experiment_id"] == "e-42"
    assert run.body["runtime_config"].get("parameters") in (None, {})


@pytest.mark.parametrize("param, needle", [
    ("bogus=1", "--param bogus: unknown parameter"),
    ("seq_len=abc", "--param seq_len: expected an integer"),
    ("launcher_node_selector=[1]", "expected a JSON object"),
    ("val_fraction", "expected name=value"),
])
def test_submit_bad_param_is_one_line_and_sends_nothing(api, capsys, param, needle):
    err = _one_line_error(capsys, main(["submit", "--host", api.url, "--param", param]))
    assert needle in err
    assert api.requests == []


def test_submit_with_registry_compiles_for_it(api):
    # a fresh process: the component modules read the registry when first imported
    reg = "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx"
    env = {k: v for k, v in os.environ.items() if k != "KFP_NVRX_REGISTRY"}
    done = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "submit", "--host",
                           api.url, "--registry", reg], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (run,) = api.calls("POST", "/apis/v2beta1/runs")
    images = {ex["container"]["image"] for ex in
              run.body["pipeline_spec"]["pipeline_spec"]["deploymentSpec"]["executors"].values()}
    assert images == {f"{reg}/kfp-nvrx-components:{__version__}",
                      f"{reg}/kfp-nvrx-trainer:{__version__}"}
    assert "localhost:5000" not in json.dumps(run.body)


def test_submit_package_and_registry_conflict(api, capsys, tmp_path):
    err = _one_line_error(capsys, main(["submit", "--host", api.url, "--registry", "r.io/x",
                                        "--package", str(tmp_path / "p.yaml")]))
    assert "--registry: cannot re-target" in err and api.requests == []


def test_submit_unknown_pipeline(api, capsys):
    err = _one_line_error(capsys, main(["submit", "--host", api.url, "--pipeline", "nope"]))
    assert "--pipeline: unknown pipeline 'nope'" in err and api.requests == []


# -- connection and auth errors -----------------------------------------------------------------

def test_unreachable_host_is_one_line(capsys):
    err = _one_line_error(capsys, main(["submit", "--host", f"http://127.0.0.1:{free_port()}"]))
    assert "--host: cannot reach" in err and "port-forward" in err


def test_host_without_scheme_is_one_line(capsys):
    err = _one_line_error(capsys, main(["submit", "--host", "localhost:8080"]))
    assert "expected an http(s) URL" in err


def test_auth_failure_is_one_line():
    with KfpApiDouble(token="s3cret") as api:
        rc = main(["submit", "--host", api.url])
        assert rc == 2
        assert [r.path for r in api.requests] == ["/apis/v2beta1/healthz"]


def test_auth_failure_message(capsys):
    with KfpApiDouble(token="s3cret") as api:
        err = _one_line_error(capsys, main(["submit", "--host", api.url]))
    assert "authentication failed" in err and "HTTP 401" in err and "--token-file" in err


def test_login_redirect_is_auth_failure(capsys):
    with KfpApiDouble(redirect_to="/dex/auth?client_id=kubeflow") as api:
        err = _one_line_error(capsys, main(["submit", "--host", api.url]))
    assert "login required" in err and "/dex/auth" in err


def test_a_huge_healthz_answer_is_read_only_in_part(capsys):
    """A healthz body past 64 KiB is no KFP API's: refused in one line, not read whole."""
    huge = {("GET", "/apis/v2beta1/healthz"): {"pad": "x" * (4 << 20)}}
    with KfpApiDouble(reply=huge) as api:
        err = _one_line_error(capsys, main(["submit", "--host", api.url]))
        assert not api.calls("POST", "/apis/v2beta1/runs")
    assert "did not answer like a KFP API" in err


def test_token_file_is_sent_as_bearer(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with KfpApiDouble(token="s3cret") as api:
        assert main(["submit", "--host", api.url, "--token-file", str(token)]) == 0
        assert api.calls("POST", "/apis/v2beta1/runs")
        assert all(r.headers.get("authorization") == "Bearer s3cret" for r in api.requests)


def test_api_refusal_is_one_line(capsys):
    with KfpApiDouble(fail={("POST", "/apis/v2beta1/runs"): (400, "pipeline spec is invalid")}) \
            as api:
        err = _one_line_error(capsys, main(["submit", "--host", api.url]))
    assert "HTTP 400" in err and "pipeline spec is invalid" in err


@pytest.mark.parametrize("host, says", [
    ("http://[::1", "Invalid IPv6 URL"), ("http://kfp:99999", "Port out of range"),
    ("http://:8080", "names no host"),
])
def test_a_malformed_host_is_one_line_naming_it(capsys, host, says):
    """``--host http://[::1`` printed "unexpected ValueError" with exit 1 (issue 30.17)."""
    err = _one_line_error(capsys, main(["submit", "--host", host]))
    assert err.startswith("kfp-nvrx submit: error: --host: ") and says in err, err


def test_a_throttling_api_says_so_at_once_not_did_not_answer(capsys):
    """urllib3 slept its Retry-After: 3600 inside the call; it read "did not answer" (30.17)."""
    import time

    route = ("GET", "/apis/v2beta1/experiments")
    with KfpApiDouble(fail={route: (429, "too many requests")}) as api:
        started = time.monotonic()
        err = _one_line_error(capsys, main(["submit", "--host", api.url, "--timeout", "30"]))
        assert time.monotonic() - started < 20
    assert "is throttling requests (HTTP 429, Retry-After 3600 s)" in err, err
    assert "did not answer" not in err and not any(r.method == "POST" for r in api.requests)


# -- schedule -----------------------------------------------------------------------------------

def test_schedule_creates_recurring_run(api, capsys):
    rc = main(["schedule", "--host", api.url, "--cron", "0 0 3 * * *", "--no-catchup",
               "--max-concurrency", "1", "--name", "nightly", "--param", "model_name=m1"])
    out = capsys.readouterr().out
    assert rc == 0
    (rec,) = api.calls("POST", "/apis/v2beta1/recurringruns")
    body = rec.body
    assert body["display_name"] == "nightly"
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}}
    assert int(body["max_concurrency"]) == 1
    assert body["no_catchup"] is True
    assert body["mode"] == "ENABLE"
    assert body["runtime_config"]["parameters"] == {"model_name": "m1"}
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "scheduled-retrain"
    assert body["experiment_id"] == api.experiments[0]["experiment_id"]
    assert "recurring run" in out and "0 0 3 * * *" in out


def test_schedule_catchup_by_default(api):
    assert main(["schedule", "--host", api.url, "--cron", "@every 6h",
                 "--pipeline", "fsdp-train"]) == 0
    (rec,) = api.calls("POST", "/apis/v2beta1/recurringruns")
    assert rec.body["no_catchup"] is False
    assert rec.body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "fsdp-train"


@pytest.mark.parametrize("cron, needle", [
    ("0 3 * * *", "expected 6 fields"),
    ("0 60 3 * * *", "minutes value 60 is outside 0-59"),
    ("0 0 3 L * *", "Quartz"),
    ("0 0 3 * * 7", "day-of-week value 7 is outside 0-6"),
])
def test_schedule_bad_cron_is_one_line_and_sends_nothing(api, capsys, cron, needle):
    err = _one_line_error(capsys, main(["schedule", "--host", api.url, "--cron", cron]))
    assert err.startswith("kfp-nvrx schedule: error: --cron:") and needle in err
    assert api.requests == []


@pytest.mark.parametrize("value", ["0", "11"])
def test_schedule_bad_concurrency(api, capsys, value):
    err = _one_line_error(capsys, main(["schedule", "--host", api.url, "--cron", "0 0 3 * * *",
                                        "--max-concurrency", value]))
    assert "--max-concurrency: must be within 1-10" in err and api.requests == []


# -- redirects are refused, never followed with the request body -------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("cmd, route", [
    (["submit"], ("POST", "/apis/v2beta1/runs")),
    (["schedule", "--cron", "0 0 3 * * *"], ("POST", "/apis/v2beta1/recurringruns")),
    (["submit"], ("POST", "/apis/v2beta1/experiments")),
    (["submit"], ("GET", "/apis/v2beta1/experiments")),
])
def test_a_redirect_after_the_probe_is_refused_and_named(status, cmd, route, capsys):
    """The POST body (pipeline spec, parameters) never reaches where the 3xx points."""
    with KfpApiDouble() as elsewhere, KfpApiDouble() as api:
        target = f"{elsewhere.url}/collect{route[1]}"
        api.redirect[route] = (status, target)
        err = _one_line_error(capsys, main([*cmd, "--host", api.url]))
        assert elsewhere.requests == []
        assert len(api.calls(*route)) == 1  # asked once, not retried
    assert "--host" in err and f"HTTP {status}" in err and target in err
    assert f"{route[0]} {route[1]}" in err and "not followed" in err


def test_a_relative_redirect_is_named_as_an_absolute_url(capsys):
    with KfpApiDouble() as api:
        api.redirect[("POST", "/apis/v2beta1/runs")] = (307, "/other/runs")
        err = _one_line_error(capsys, main(["submit", "--host", api.url]))
        assert api.calls("POST", "/other/runs") == []
    assert f"redirecting to {api.url}/other/runs" in err


# -- units --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cron", [
    "0 0 3 * * *", "0 */15 * * * *", "0 0 9 ? * MON-FRI", "0 30 2 1,15 JAN-DEC *", "@daily",
    "@every 6h", "@every 1h30m", "  0  0 3 * * *  ", "0 0 0-23/2 * JUL WED",
])
def test_valid_cron(cron):
    assert validate_cron(cron) == " ".join(cron.split())


@pytest.mark.parametrize("cron", [
    "", "* * * * * * *", "60 * * * * *", "0 0 24 * * *", "0 0 0 0 * *", "0 0 0 * 13 *",
    "0 0 3 * * 5-1", "0 0 3 * * MON#2", "0 0 3 15W * *", "0 */0 * * * *", "0 0 3 * FOO *",
    "@every soon", "@fortnightly", "? 0 3 * * *",
])
def test_invalid_cron(cron):
    with pytest.raises(UserError) as err:
        validate_cron(cron)
    assert err.value.field == "--cron"


@pytest.mark.parametrize("cron", [
    "0 0 0 30 2 *", "0 0 0 31 4 *", "0 0 0 31 2,4,6,9,11 *", "0 0 12 30-31 FEB ?",
    "0 0 0 31 SEP */1",
])
def test_cron_that_can_never_fire_is_refused(cron):
    """Day-of-month and month that no calendar date has: croniter finds no firing in 400 years."""
    with pytest.raises(UserError) as err:
        validate_cron(cron)
    assert err.value.field == "--cron" and "never fires" in err.value.message


@pytest.mark.parametrize("cron", ["0 0 0 29 2 *", "0 0 0 30 2 MON", "0 0 0 31 * *"])
def test_cron_that_fires_rarely_or_by_weekday_passes(cron):
    """Feb 29 fires in leap years; with a weekday set robfig ORs the two day fields."""
    assert validate_cron(cron) == cron


@pytest.mark.parametrize("cron, needle", [
    ("0 0 3 * * 7", "outside 0-6"), ("0 0 0 1 DEC-JAN *", "backwards"), ("0 0 3 L * *", "extensions"),
    ("0 0 3 * * 1#2", "extensions"), ("H 0 3 * * *", "extensions"), ("0 0 3 1,,2 * *", "valid"),
])
def test_what_croniter_reads_but_kfp_refuses_is_refused(cron, needle):
    with pytest.raises(UserError) as err:
        validate_cron(cron)
    assert needle in err.value.message and "\n" not in err.value.one_line()


def test_parse_params_types():
    spec = {"s": {"parameterType": "STRING"}, "i": {"parameterType": "NUMBER_INTEGER"},
            "f": {"parameterType": "NUMBER_DOUBLE"}, "b": {"parameterType": "BOOLEAN"},
            "l": {"parameterType": "LIST"}, "d": {"parameterType": "STRUCT"}}
    got = parse_params(["s=a=b", "i=3", "f=0.5", "b=true", "l=x,y", "d={\"k\": 1}"], spec)
    assert got == {"s": "a=b", "i": 3, "f": 0.5, "b": True, "l": ["x", "y"], "d": {"k": 1}}
    assert parse_params(["l=[\"a,b\"]"], spec) == {"l": ["a,b"]}
    with pytest.raises(UserError, match="expected true or false"):
        parse_params(["b=maybe"], spec)
