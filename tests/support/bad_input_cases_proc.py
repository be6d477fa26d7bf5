"""Bad-input sweep cases for secrets, the network and processes (issue 23 items 5, 6, 10, 11).

Same format as tests/support/bad_input_cases.py; tests/integration/test_bad_inputs.py collects ``CASES``,
``COMPONENT_CASES`` and ``fixtures(fx)``. The network cases talk to KFP API test doubles
(tests/support/kfp_api_double.py, not a real KFP server) started once by :func:`fixtures`: one whose
replies echo the bearer token, as a misconfigured server's error does, and ones that redirect.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kfp import dsl

from support.bad_input_cases import HOST, RENDER, SECRET, Case, _c
from support.kfp_api_double import KfpApiDouble

#: A 3-character token: redacted as a whole token, never inside a word.
SHORT = "q7z"
HEX64 = "0123456789abcdef" * 4
LAUNCH_K8S = ("launch", "--backend", "kubernetes", "--pvc", "shared", "--kubeconfig",
              "{fx}/kubeconfig")
TRAINJOB = ("render-job", "--job-api", "trainjob", "--pvc", "shared", "--out", "{ws}/job.yaml")
#: The sweep's RENDER without its image (each image case gives its own).
RENDER_NO_IMAGE = tuple(a for i, a in enumerate(RENDER) if i not in (1, 2))

_IMAGES = [  # (id, reference, words the line must hold)
    ("newline", "img:1\nX-Evil: 1", "invalid image"), ("space", "img 1", "invalid image"),
    ("tab", "img:1\t", "invalid image"), ("leading-space", " img:1", "invalid image"),
    ("del-char", "img:1\x7f", "invalid image"),
    ("digest-short", "img@sha256:abc", "64 lower-case hex"),
    ("digest-long", f"img@sha256:{HEX64}0", "64 lower-case hex"),
    ("digest-upper", f"img@sha256:{HEX64.upper()}", "64 lower-case hex"),
    ("digest-sha512-short", f"img@sha512:{HEX64}", "128 lower-case hex"),
    ("digest-algorithm", f"img@md5:{HEX64}", "digest algorithm"),
    ("upper-repo", "Img:1", "lower-case"), ("upper-path", "ghcr.io/Owner/img:1", "lower-case"),
    ("empty-tag", "img:", "invalid image"), ("double-colon", "img::1", "invalid image"),
    ("double-slash", "reg.io//img:1", "invalid image"), ("tag-dash", "img:-1", "invalid image"),
    ("tag-too-long", "img:" + "t" * 129, "invalid image"),
    ("name-too-long", "a" * 256 + ":1", "at most 255"),
]

_CRONS = [  # (id, expression, words the line must hold)
    ("feb-30", "0 0 0 30 2 *", "never fires"), ("apr-31", "0 0 0 31 4 *", "never fires"),
    ("31-short-months", "0 0 12 31 2,4,6,9,11 *", "never fires"),
    ("feb-range-question", "0 30 6 30-31 FEB ?", "never fires"),
    ("sep-31-every-day", "0 0 0 31 SEP */1", "never fires"),
    ("nov-31-names", "0 0 0 31 NOV *", "never fires"),
    ("dow-7", "0 0 3 * * 7", "outside 0-6"), ("months-backwards", "0 0 0 1 DEC-JAN *",
                                               "backwards"),
    ("quartz-last", "0 0 3 L * *", "extensions"), ("jenkins-hash", "H 0 3 * * *", "extensions"),
    ("empty-item", "0 0 3 1,,2 * *", "not valid"), ("hex-number", "0x1 0 3 * * *", "not valid"),
]

CASES: list[Case] = [
    # 10. image references follow the container reference grammar (render-job, both job APIs,
    # and launch before any credential is read)
    *[_c(f"image-{id_}", "--image", *RENDER_NO_IMAGE, "--image", ref, says=says)
      for id_, ref, says in _IMAGES],
    *[_c(f"trainjob-image-{id_}", "--image", *TRAINJOB, "--image", ref, says=says)
      for id_, ref, says in _IMAGES[:3] + _IMAGES[5:7] + _IMAGES[10:11]],
    _c("launch-image-upper", "--image", *LAUNCH_K8S, "--image", "Trainer:1", says="lower-case"),
    _c("launch-image-digest", "--image", *LAUNCH_K8S, "--image", "t@sha256:00",
       says="64 lower-case hex"),
    # 10. cron expressions that can never fire, or that KFP's robfig/cron refuses
    *[_c(f"cron-{id_}", "--cron", "schedule", "--host", HOST, "--cron", expr, says=says)
      for id_, expr, says in _CRONS],
    # 5. whatever a server sends back is redacted: the double's error quotes the bearer token
    _c("submit-echoed-token", "--host", "submit", "--host", "{echo_long}", "--token-file",
       "{token_long}", says="<redacted>"),
    _c("submit-echoed-short-token", "--host", "submit", "--host", "{echo_short}", "--token-file",
       "{token_short}", says="'Bearer <redacted>' for user q7zebra"),
    _c("schedule-echoed-token", "--host", "schedule", "--host", "{echo_long}", "--token-file",
       "{token_long}", "--cron", "0 0 3 * * *", says="<redacted>"),
    _c("submit-login-redirect-with-token", "--host", "submit", "--host", "{login}",
       "--token-file", "{token_long}", says="redirected to https://login.example/?t=<redacted>"),
    # 6. a 3xx after the probe is refused, never followed with the request (and its body)
    _c("submit-redirect-307-post", "--host", "submit", "--host", "{redirect_post}",
       says="not followed"),
    _c("submit-redirect-302-get", "--host", "submit", "--host", "{redirect_get}",
       says="redirecting to http://127.0.0.1:9/elsewhere"),
    _c("schedule-redirect-308", "--host", "schedule", "--host", "{redirect_post}", "--cron",
       "0 0 3 * * *", says="not followed"),
    # 11. one run owns a run dir: a run dir still held (here by a process that was handed the
    # lock, as an agent is) is refused, whoever holds it
    _c("local-run-dir-held", "--run-dir", "launch-local", "--run-dir", "{heldrun}", "--set",
       "data.path={data}", says="in use"),
]

#: What a Kubernetes training task gets from the pipeline: everything on the shared volume.
_ON_VOLUME = {"backend": "kubernetes", "workspace": "/fsx/work", "pvc_name": "shared",
              "dataset": dsl.Dataset(uri="/fsx/data", metadata={"path": "/fsx/data"})}

COMPONENT_CASES = [  # (id, component, parameters, field the error must name)
    ("train-image-newline", "train", {**_ON_VOLUME, "trainer_image": "img:1\nx"}, "image"),
    ("train-image-upper", "train", {**_ON_VOLUME, "trainer_image": "Img:1"}, "image"),
    ("train-image-digest", "train", {**_ON_VOLUME, "trainer_image": "t@sha256:0"}, "image"),
]

#: The doubles and the lock holder live as long as the sweep (the test process).
_KEEP: list[object] = []

_HOLDER = """
import sys, time
from kfp_nvrx.components.core.ownership import claim_run_dir
from kfp_nvrx.components.launch.local.lifetime import RunDirLock
claim_run_dir(sys.argv[1])
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(3600)
"""


def _double(**kwargs: object) -> str:
    double = KfpApiDouble(**kwargs).__enter__()  # noqa: PLC2801 - closed with the process
    _KEEP.append(double)
    return double.url


def fixtures(fx: Path) -> dict[str, str]:
    """Token files, KFP API doubles and a run dir whose lock a live process holds."""
    from kfp_nvrx.components.launch.local.lifetime import die_with_parent

    (fx / "token_long").write_text(f"{SECRET}\n")
    (fx / "token_short").write_text(f"{SHORT}\n")
    list_route = ("GET", "/apis/v2beta1/experiments")
    echo_long = _double(token=SECRET, fail={list_route: (
        500, f"cannot verify 'Authorization: Bearer {SECRET}' (token={SECRET})")})
    echo_short = _double(token=SHORT, fail={list_route: (
        500, f"invalid 'Bearer {SHORT}' for user q7zebra")})
    login = _double(redirect_to=f"https://login.example/?t={SECRET}")
    redirect_post = _double(redirect={("POST", "/apis/v2beta1/experiments"): (
        307, f"{HOST}/elsewhere"), ("POST", "/apis/v2beta1/recurringruns"): (308, HOST)})
    redirect_get = _double(redirect={list_route: (302, f"{HOST}/elsewhere")})
    held = fx / "heldrun"
    # The holder dies with this test process (the same leash the agents have).
    holder = subprocess.Popen(die_with_parent([sys.executable, "-c", _HOLDER, str(held)]),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    _KEEP.append(holder)
    return {"token_long": str(fx / "token_long"), "token_short": str(fx / "token_short"),
            "echo_long": echo_long, "echo_short": echo_short, "login": login,
            "redirect_post": redirect_post, "redirect_get": redirect_get, "heldrun": str(held)}
