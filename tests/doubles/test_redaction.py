"""One redaction for every credential, applied to everything printed (components/redaction.py).

Units check the matching rules (whole tokens for short values, anywhere for long ones, lines
split over writes); the end-to-end cases point ``kfp-nvrx launch`` and ``submit`` at servers that
answer every request with an error echoing the credential they were sent, as a misconfigured API
server's 500 does, and grep everything the command wrote.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.kfp_api_double import KfpApiDouble

from kfp_nvrx.components import redaction
from kfp_nvrx.components.redaction import REDACTED, RedactingStream, redact

SHORT = "q7z"  # a 3-character token: must be cut out whole, never inside a word
LONG = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXBheWxvYWQ.sig-7f3a9c"


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.setattr(redaction, "_values", set())
    monkeypatch.setattr(redaction, "_sources", [])


def _standalone(token: str, text: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(token)}(?![A-Za-z0-9])", text) is not None


# -- units ------------------------------------------------------------------------------------

def test_a_short_token_is_cut_out_whole_and_nowhere_else():
    redaction.register(SHORT)
    text = f"Authorization: Bearer {SHORT}, user q7zebra, xq7z, token={SHORT}&x; was {SHORT}."
    assert redact(text) == (f"Authorization: Bearer {REDACTED}, user q7zebra, xq7z, "
                            f"token={REDACTED}&x; was {REDACTED}.")


def test_a_long_token_is_cut_out_even_glued_to_other_text():
    redaction.register(f"Bearer {LONG}")  # a header value registers the token after the scheme
    out = redact(f"got 'Bearer {LONG}' and x{LONG}y")
    assert LONG not in out and out.count(REDACTED) == 2 and "Bearer" in out


def test_one_value_inside_another_is_cut_out_whole():
    redaction.register("abc", "abc-def-ghi")
    assert redact("abc-def-ghi and abc") == f"{REDACTED} and {REDACTED}"


def test_url_credentials_and_extra_values():
    assert redact("GET https://bob:pw@h/x with t0k", ["t0k"]) == \
        f"GET https://{REDACTED}@h/x with {REDACTED}"


def test_stream_sees_a_token_split_over_two_writes():
    redaction.register(SHORT)
    inner = io.StringIO()
    stream = RedactingStream(inner)
    stream.write("denied: Bearer q7")
    assert inner.getvalue() == ""  # held back until the line is complete
    stream.write("z\nnext ")
    stream.flush()
    assert inner.getvalue() == f"denied: Bearer {REDACTED}\nnext "


def test_a_refreshed_kube_token_is_redacted_too():
    from kubernetes import client

    cfg = client.Configuration()
    cfg.api_key = {"authorization": "Bearer first-token-0001"}
    redaction.register_kube_configuration(cfg)
    cfg.api_key = {"authorization": "Bearer refreshed-token-0002"}  # an exec plugin's refresh
    out = redact("first-token-0001 / refreshed-token-0002")
    assert out == f"{REDACTED} / {REDACTED}"


def test_every_credential_of_a_kubeconfig_is_registered_before_loading(tmp_path):
    pem = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIKeyBodyLine1abcdefgh\n-----END EC PRIVATE KEY-----\n"
    (tmp_path / "token").write_text("from-a-token-file\n")
    kc = tmp_path / "kubeconfig"
    kc.write_text(json.dumps({"users": [
        {"name": "a", "user": {"token": SHORT}},
        {"name": "b", "user": {"username": "admin", "password": "pw1"}},
        {"name": "c", "user": {"tokenFile": str(tmp_path / "token")}},
        {"name": "d", "user": {"client-key-data": base64.b64encode(pem.encode()).decode()}},
    ]}))
    redaction.register_kubeconfig(str(kc))
    basic = base64.b64encode(b"admin:pw1").decode()
    text = f"{SHORT} pw1 from-a-token-file MHcCAQEEIKeyBodyLine1abcdefgh Basic {basic}"
    assert redact(text) == " ".join([REDACTED] * 4 + ["Basic", REDACTED])


def test_a_kubeconfig_yaml_cannot_parse_still_has_its_token_registered(tmp_path):
    kc = tmp_path / "kubeconfig"
    kc.write_text(f'users:\n- name: u\n  user: {{token: "{LONG}", password: pw2}}\n  - [\n')
    redaction.register_kubeconfig(str(kc))
    assert redact(f"{LONG} pw2") == f"{REDACTED} {REDACTED}"


# -- end to end: servers that echo the credential ---------------------------------------------

class _EchoingApiServer:
    """An HTTP server answering every request 500, its message quoting our Authorization."""

    def __enter__(self) -> _EchoingApiServer:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                auth = self.headers.get("Authorization", "")
                body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "code": 500, "reason": "InternalError",
                                   "message": f"cannot verify '{auth}' for user q7zebra"}).encode()
                self.send_response(500)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"


def _kubeconfig(path: Path, server: str, user: dict) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "t"}}]}))
    return path


@pytest.mark.parametrize("kind", ["short-token", "long-token", "token-file", "basic-auth"])
def test_an_api_server_echoing_our_credential_prints_none_of_it(kind, tmp_path):
    secrets = {"short-token": [SHORT], "long-token": [LONG], "token-file": [LONG],
               "basic-auth": ["pw1", base64.b64encode(b"admin:pw1").decode()]}[kind]
    user = {"short-token": {"token": SHORT}, "long-token": {"token": LONG},
            "token-file": {"tokenFile": str(tmp_path / "tok")},
            "basic-auth": {"username": "admin", "password": "pw1"}}[kind]
    (tmp_path / "tok").write_text(LONG)  # the kubernetes client sends a newline as part of it
    result = tmp_path / "result.json"
    with _EchoingApiServer() as api:
        kc = _kubeconfig(tmp_path / "kubeconfig", api.url, user)
        proc = subprocess.run(
            [sys.executable, "-m", "kfp_nvrx.components.cli", "launch", "--backend", "kubernetes",
             "--image", "img:1", "--pvc", "shared", "--kubeconfig", str(kc), "--deadline", "60",
             "--result", str(result)],
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
            env={k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"})
    everything = proc.stdout + proc.stderr + (result.read_text() if result.exists() else "")
    assert "500" in everything, everything  # the server's answer is reported ...
    assert "q7zebra" in everything  # ... not garbled where a word merely contains the token ...
    for secret in secrets:  # ... and without the credential it echoed
        assert not _standalone(secret, everything), everything
    assert REDACTED in everything


def test_kfp_api_echoing_a_short_token_is_redacted_whole(tmp_path):
    token = tmp_path / "token"
    token.write_text(f"{SHORT}\n")
    fail = {("POST", "/apis/v2beta1/runs"): (500, f"Bearer {SHORT} not valid for q7zebra")}
    with KfpApiDouble(token=SHORT, fail=fail) as api:
        proc = subprocess.run([sys.executable, "-m", "kfp_nvrx.components.cli", "submit", "--host",
                               api.url, "--token-file", str(token)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "KFP_NVRX_REGISTRY": ""})
    assert proc.returncode == 2, proc.stderr
    assert "HTTP 500" in proc.stderr and "q7zebra" in proc.stderr
    assert f"Bearer {REDACTED} not valid" in proc.stderr
    assert not _standalone(SHORT, proc.stdout + proc.stderr)


def test_the_training_component_prints_and_raises_no_credential(tmp_path, monkeypatch, capsys):
    """The KFP component (in-process, as the executor calls it) against the echoing server."""
    from kfp import dsl

    from kfp_nvrx.components.train_fsdp.component import train_fsdp

    with _EchoingApiServer() as api:
        kc = _kubeconfig(tmp_path / "kubeconfig", api.url, {"token": SHORT})
        monkeypatch.setenv("KUBECONFIG", str(kc))
        from kubernetes.config import kube_config  # reads $KUBECONFIG once, at import

        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kc))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.chdir(tmp_path)
        out = tmp_path / "outputs"
        with pytest.raises(RuntimeError) as err:
            train_fsdp.python_func(
                dataset=dsl.Dataset(uri="/fsx/data", metadata={"path": "/fsx/data"}),
                workspace="/fsx/work", run=dsl.Artifact(uri=str(out / "run")),
                metrics=dsl.Metrics(uri=str(out / "metrics")),
                timeline=dsl.HTML(uri=str(out / "timeline")), backend="kubernetes",
                job_api="pytorchjob", trainer_image="img:1", pvc_name="shared",
                kfp_run_id="run-1", kfp_task="train-fsdp")
    printed = capsys.readouterr()
    everything = str(err.value) + printed.out + printed.err
    assert "500" in everything and "q7zebra" in everything
    assert not _standalone(SHORT, everything), everything


def test_terminal_controls_from_pod_logs_are_shown_not_acted_on():
    """A pod's escape sequences reached the terminal raw: retitle, clear, cursor moves (30.17)."""
    out = io.StringIO()
    stream = RedactingStream(out)
    stream.write("[worker-1] \x1b]0;pwned\x07title \x1b[2Jcleared \x1b[1A up\r over\n")
    stream.write("[worker-0] \x9b31m c1 \x1b[31mred\x1b[0m tab\there\r\n")
    stream.write("partial \x08 no newline")
    stream.flush()
    text = out.getvalue()
    assert "\x1b]" not in text and "\x1b[2J" not in text and "\x1b[1A" not in text
    assert "\x07" not in text and "\x9b" not in text and "\x08" not in text
    assert "\\x1b]0;pwned\\x07title \\x1b[2Jcleared \\x1b[1A up\\x0d over\n" in text
    assert "\\x9b31m c1 \x1b[31mred\x1b[0m tab\there\r\n" in text  # colours and CRLF stay
    assert text.endswith("partial \\x08 no newline")
