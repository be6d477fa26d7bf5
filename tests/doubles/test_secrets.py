"""No credential ever reaches an output, and a misbehaving KFP API never hangs or fakes success.

Every case runs ``submit``/``schedule`` against the KFP API test double (``kfp_api_double``) or an
address where nothing listens, with a secret that is unique to the test, then greps everything the
command wrote (stdout, stderr, log records) for it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from support.kfp_api_double import KfpApiDouble

from kfp_nvrx.components.cli.main import main
from kfp_nvrx.components.errors import REDACTED, UserError, redact
from kfp_nvrx.pipelines.client import validate_cron

SECRET = "tok-6f1d93b2a7c4e5-SECRET"
PASSWORD = "pw-0b5e77a1c9-SECRET"


@pytest.fixture(autouse=True)
def _no_kfp_context(tmp_path, monkeypatch):
    from kfp.client import client as kfp_client

    monkeypatch.setattr(kfp_client.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "context.json"))
    for var in ("KFP_NVRX_REGISTRY", "KF_PIPELINES_ENDPOINT", "KF_PIPELINES_UI_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)


def _run(argv, capsys, caplog) -> tuple[int, str]:
    with caplog.at_level(logging.DEBUG):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own one-line refusals (nan, out of range) exit 2
            rc = e.code
    out = capsys.readouterr()
    everything = out.out + out.err + "\n".join(r.getMessage() for r in caplog.records)
    for secret in (SECRET, PASSWORD, SECRET.split("-")[1], PASSWORD.split("-")[1]):
        assert secret not in everything, everything
    return rc, out.err.strip()


def _token_file(tmp_path, content: bytes):
    path = tmp_path / "token"
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("content, needle", [
    (f"{SECRET}\nsecond-line-{SECRET}\n".encode(), "2 non-empty lines"),
    (f"Bearer {SECRET}\n".encode(), "one word"),
    (f"{SECRET}\x7f\n".encode(), "control"),
    (b"\xff\xfe" + SECRET.encode(), "not a text file"),
    (f"{SECRET}é\n".encode(), "non-ASCII"),
])
def test_malformed_token_file_is_refused_without_echoing_it(content, needle, tmp_path, capsys,
                                                            caplog):
    with KfpApiDouble(token=SECRET) as api:
        rc, err = _run(["submit", "--host", api.url, "--token-file",
                        _token_file(tmp_path, content)], capsys, caplog)
        assert not api.requests  # refused before anything was sent
    assert rc == 2 and "--token-file" in err and needle in err and "\n" not in err


def test_password_in_host_is_refused_and_never_printed(capsys, caplog):
    with KfpApiDouble() as api:
        host = api.url.replace("http://", f"http://admin:{PASSWORD}@")
        for cmd in (["submit"], ["schedule", "--cron", "0 0 3 * * *"]):
            rc, err = _run([*cmd, "--host", host], capsys, caplog)
            assert rc == 2 and "--host" in err and "--token-file" in err
        assert not api.requests


def test_newline_in_host_is_one_line(capsys, caplog):
    rc, err = _run(["submit", "--host", "http://localhost:8080\nX-Evil: 1"], capsys, caplog)
    assert rc == 2 and "--host" in err and "\n" not in err


def test_api_error_echoing_the_token_is_redacted(tmp_path, capsys, caplog):
    fail = {("POST", "/apis/v2beta1/runs"): (400, f"bad header Authorization: Bearer {SECRET}")}
    with KfpApiDouble(token=SECRET, fail=fail) as api:
        rc, err = _run(["submit", "--host", api.url, "--token-file",
                        _token_file(tmp_path, f"{SECRET}\n".encode())], capsys, caplog)
    assert rc == 2 and "HTTP 400" in err and REDACTED in err


def test_unreachable_host_with_token_does_not_print_it(tmp_path, capsys, caplog):
    rc, err = _run(["submit", "--host", "http://127.0.0.1:9", "--token-file",
                    _token_file(tmp_path, f"{SECRET}\n".encode())], capsys, caplog)
    assert rc == 2 and "cannot reach" in err


def test_token_is_still_sent_and_works(tmp_path, capsys, caplog):
    with KfpApiDouble(token=SECRET) as api:
        rc, _ = _run(["submit", "--host", api.url, "--token-file",
                      _token_file(tmp_path, f"  {SECRET}  \n\n".encode())], capsys, caplog)
        assert rc == 0
        assert api.calls("POST", "/apis/v2beta1/runs")[0].headers["authorization"] == \
            f"Bearer {SECRET}"


def test_a_subprocess_never_prints_the_secret(tmp_path):
    """The whole program (imports, logging set up by kfp) and not only main()."""
    token = _token_file(tmp_path, f"{SECRET}\n{SECRET}\n".encode())
    with KfpApiDouble(token=SECRET) as api:
        for argv in (["--token-file", token, "--host", api.url],
                     ["--host", api.url.replace("//", f"//u:{PASSWORD}@")]):
            proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "submit",
                                   *argv], capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "KFP_NVRX_REGISTRY": ""})
            assert proc.returncode == 2, proc.stderr
            assert SECRET not in proc.stdout + proc.stderr
            assert PASSWORD not in proc.stdout + proc.stderr


def test_redact_cuts_secrets_and_url_credentials():
    text = f"GET https://bob:{PASSWORD}@h/x with {SECRET} and {SECRET}"
    out = redact(text, [SECRET])
    assert SECRET not in out and PASSWORD not in out and out.count(REDACTED) == 3


# -- a misbehaving API -------------------------------------------------------------------------

def test_stalled_api_after_the_probe_times_out(capsys, caplog):
    with KfpApiDouble(stall={("POST", "/apis/v2beta1/runs"): 60}) as api:
        started = time.monotonic()
        rc, err = _run(["submit", "--host", api.url, "--timeout", "2"], capsys, caplog)
        assert time.monotonic() - started < 30
    assert rc == 2 and "did not answer within 2s" in err and "--timeout" in err


@pytest.mark.parametrize("cmd, route", [
    (["submit"], ("POST", "/apis/v2beta1/runs")),
    (["schedule", "--cron", "0 0 3 * * *"], ("POST", "/apis/v2beta1/recurringruns")),
])
def test_reply_without_an_id_is_an_error(cmd, route, capsys, caplog):
    with KfpApiDouble(reply={route: {"state": "PENDING"}}) as api:
        rc, err = _run([*cmd, "--host", api.url], capsys, caplog)
    assert rc == 2 and "without a" in err and "None" not in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_must_be_positive_and_finite(value, capsys, caplog):
    rc, err = _run(["submit", "--host", "http://127.0.0.1:9", "--timeout", value], capsys, caplog)
    assert rc == 2 and "--timeout" in err


@pytest.mark.parametrize("cron", ["@every 1s", "@every 1ns", "@every 59s", "* * * * * *",
                                  "*/5 0 3 * * *", "0,30 * * * * *", "0-1 0 3 * * *"])
def test_schedules_firing_more_than_once_a_minute_are_refused(cron):
    with pytest.raises(UserError) as err:
        validate_cron(cron)
    assert err.value.field == "--cron" and "once a minute" in err.value.message


@pytest.mark.parametrize("cron", ["@every 1m", "@every 1h30m", "0 * * * * *", "0 */5 * * * *"])
def test_schedules_at_most_once_a_minute_pass(cron):
    assert validate_cron(cron)
