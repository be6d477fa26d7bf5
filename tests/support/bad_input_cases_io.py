"""Bad-input sweep cases for what is read and written around a run (issue 30 items 8, 11-15, 17).

Same format as tests/support/bad_input_cases.py; tests/integration/test_bad_inputs.py collects ``CASES``,
``COMPONENT_CASES`` and ``fixtures(fx)``. The classes: outputs that must never replace a FIFO,
device, socket or link (``render-job --out``, ``launch --result``, ``run-local --out``, checked
before any work); special files inside a run dir where we write (``events.jsonl`` as a FIFO hung
the run); ``checkpoint.init_from`` files the safetensors library refuses; kubeconfigs (and the
files they name) that are FIFOs, devices or huge; goodput of a run without events; the KFP
``--host`` that no URL parser takes and a KFP API that throttles; and the export of a run made
on the cluster, whose ``data.path`` is not here.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from pathlib import Path

from support.bad_input_cases import HOST, LAUNCH, RENDER, TRAINER, Case, _c
from support.kfp_api_double import KfpApiDouble
from support.recorded_runs import recorded_run

RENDER_NO_OUT = RENDER[:-2]
TRAINJOB_NO_OUT = ("render-job", "--job-api", "trainjob", "--image", "img:1", "--pvc", "shared")
K8S = ("launch", "--backend", "kubernetes", "--image", "i:1", "--pvc", "shared")
#: Special files an output must never replace, by fixture name.
SPECIALS = {"outfifo": "FIFO", "outsock": "socket", "outdev": "character device",
            "outlink": "symbolic link", "outdangling": "symbolic link"}

_SAFETENSORS = {  # fixture -> (header, data bytes, words the line must hold)
    "stdtype": ({"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, 16,
                "dtype 'F33'"),
    "stsize": ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 12, "needs 16"),
    "stgap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, 20, "gap at byte"),
    "stoverlap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlaps"),
    "sttrailing": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 12,
                   "trailing bytes"),
    "stboolshape": ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4,
                    "shape"),
    "stmetadata": ({"__metadata__": {"format": 1},
                    "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 4,
                   "__metadata__"),
    "stentry": ({"w": [0, 4]}, 4, "not a mapping"),
}

_RUN_DIRS = {  # fixture -> (entry, what it is, words the line must hold)
    "eventsfifo": ("events.jsonl", "fifo", "FIFO"), "eventsdir": ("events.jsonl", "dir", "directory"),
    "configfifo": ("config.yaml", "fifo", "FIFO"), "resumeddir": ("config.resumed.yaml", "dir",
                                                                 "directory"),
    "logfifo": ("logs/node0.log", "fifo", "FIFO"), "ckptfile": ("checkpoints", "file", "a file"),
    "sockevents": ("events.jsonl", "socket", "socket"),
}

_KUBECONFIGS = {  # fixture -> (user/cluster entry it holds, words the line must hold)
    "kctokenzero": ("user", {"tokenFile": "/dev/zero"}, "character device"),
    "kctokenfifo": ("user", {"tokenFile": "pipe.txt"}, "FIFO"),
    "kckeyfifo": ("user", {"client-key": "pipe.txt"}, "FIFO"),
    "kccertdir": ("user", {"client-certificate": "empty"}, "directory"),
    "kccadev": ("cluster", {"certificate-authority": "/dev/urandom"}, "character device"),
}

CASES: list[Case] = [
    # 11. outputs never replace a FIFO, device, socket or link; checked before any work
    *[_c(f"job-out-{name[3:]}", "--out", *RENDER_NO_OUT, "--out", f"{{{name}}}", says=what)
      for name, what in SPECIALS.items()],
    _c("job-out-under-a-file", "--out", *RENDER_NO_OUT, "--out", "{iofile}/job.yaml"),
    *[_c(f"trainjob-out-{name[3:]}", "--out", *TRAINJOB_NO_OUT, "--out", f"{{{name}}}",
         says=what) for name, what in list(SPECIALS.items())[:2]],
    *[_c(f"launch-result-{name[3:]}", "--result", *K8S, "--result", f"{{{name}}}", says=what)
      for name, what in SPECIALS.items()],
    _c("launch-result-directory", "--result", *K8S, "--result", "{empty}",
       says="directory"),
    _c("launch-result-under-a-file", "--result", *K8S, "--result", "{iofile}/result.json",
       says="not a folder"),
    _c("launch-local-result-fifo", "--result", "launch", "--backend", "local", "--run-dir",
       "{ws}/run", "--set", "data.path={data}", "--result", "{outfifo}", says="FIFO"),
    _c("run-local-out-dev-null", "--out", "run-local", "--out", "/dev/null",
       says="character device, not a folder"),
    _c("run-local-out-fifo", "--out", "run-local", "--out", "{outfifo}", says="FIFO"),
    _c("run-local-out-a-file", "--out", "run-local", "--out", "{iofile}", says="a file"),
    _c("run-local-out-dangling", "--out", "run-local", "--out", "{outdangling}",
       says="symbolic link"),
    _c("compile-out-fifo", "--out", "compile", "--out", "{outfifo}"),
    _c("demo-out-fifo", "--out", "demo", "--out", "{outfifo}"),
    _c("drill-out-fifo", "--out", "drill", "--out", "{outfifo}"),
    _c("prep-out-fifo", "--out", "prepare-data", "--source", "sample:", "--out", "{outfifo}"),
    _c("prep-out-under-a-file", "--out", "prepare-data", "--source", "sample:", "--out",
       "{iofile}/ds"),
    _c("export-out-fifo", "--out", "export", "--run-dir", "{recorded}", "--out", "{outfifo}",
       "--eval-batches", "0"),
    _c("export-out-under-a-file", "--out", "export", "--run-dir", "{recorded}", "--out",
       "{iofile}/model", "--eval-batches", "0"),
    # 14. a run dir holding a FIFO, socket or folder where we write: refused, never waited on
    *[_c(f"local-run-dir-{name}", "--run-dir", "launch-local", "--run-dir", f"{{{name}}}",
         "--set", "data.path={data}", says=says) for name, (_, _, says) in _RUN_DIRS.items()],
    *[_c(f"trainer-run-dir-{name}", "--run-dir", *TRAINER[:2], "--run-dir", f"{{{name}}}",
         "--set", "data.path={data}", program="trainer", says=says)
      for name, (_, _, says) in list(_RUN_DIRS.items())[:2]],
    _c("launch-local-backend-events-fifo", "--run-dir", "launch", "--backend", "local",
       "--run-dir", "{eventsfifo}", "--set", "data.path={data}", says="FIFO"),
    # 14. init_from files that pass a header parse but that the safetensors library refuses
    *[_c(f"local-init-from-{name[2:]}", "checkpoint.init_from", *LAUNCH, "--set",
         f"checkpoint.init_from={{{name}}}", says=says)
      for name, (_, _, says) in _SAFETENSORS.items()],
    _c("local-init-from-fifo", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={stfifo}", says="FIFO"),
    # issue 38 item 4: the tiny model's weights with one F32 tensor relabelled I32 (same bytes)
    _c("local-init-from-relabelled-dtype", "checkpoint.init_from", *LAUNCH, "--set",
       "checkpoint.init_from={strelabel}", says="as I32"),
    _c("trainer-init-from-relabelled-dtype", "checkpoint.init_from", *TRAINER, "--set",
       "checkpoint.init_from={strelabel}", program="trainer", says="as I32"),
    *[_c(f"trainer-init-from-{name[2:]}", "checkpoint.init_from", *TRAINER, "--set",
         f"checkpoint.init_from={{{name}}}", program="trainer", says=says)
      for name, (_, _, says) in list(_SAFETENSORS.items())[:5:4]],
    # 15. goodput of a run with no events to summarise, or something else in their place
    *[_c(f"goodput-events-{name}", "--run-dir", "goodput", "--run-dir", f"{{{name}}}",
         says=says) for name, says in (("eventsfifo", "FIFO"), ("eventsdir", "directory"),
                                       ("eventsempty", "holds no events"),
                                       ("eventsblank", "holds no events"),
                                       ("eventsdamaged", "holds no events"),
                                       ("sockevents", "cannot read"))],
    # 12. a kubeconfig, or a file it names, that is a FIFO, device, folder or huge
    _c("launch-kubeconfig-fifo", "--kubeconfig", *K8S, "--kubeconfig", "{fifo}", says="FIFO"),
    # issue 38 item 4: nesting the YAML parser recurses on ("unexpected RecursionError" before)
    _c("launch-kubeconfig-nested", "--kubeconfig", *K8S, "--kubeconfig", "{kcnested}",
       says="nests deeper"),
    _c("launch-env-kubeconfig-nested", "--kubeconfig", *K8S, says="nests deeper",
       KUBECONFIG="{kcnested}"),
    _c("launch-kubeconfig-dir", "--kubeconfig", *K8S, "--kubeconfig", "{empty}",
       says="directory"),
    _c("launch-kubeconfig-dev-zero", "--kubeconfig", *K8S, "--kubeconfig", "/dev/zero",
       says="character device"),
    _c("launch-kubeconfig-huge", "--kubeconfig", *K8S, "--kubeconfig", "{bigyaml}",
       says="larger than"),
    *[_c(f"launch-{name}", "--kubeconfig", *K8S, "--kubeconfig", f"{{{name}}}", says=says)
      for name, (_, _, says) in _KUBECONFIGS.items()],
    _c("launch-env-kubeconfig-fifo", "--kubeconfig", *K8S, says="FIFO",
       KUBECONFIG="{fifo}"),
    _c("launch-env-kubeconfig-list", "--kubeconfig", *K8S, says="character device",
       KUBECONFIG="{fx}/nope.yaml" + os.pathsep + "{kctokenzero}"),
    _c("launch-trainjob-kubeconfig-token", "--kubeconfig", *K8S, "--job-api", "trainjob",
       "--kubeconfig", "{kctokenzero}", says="character device"),
    # 17. a --host no URL parser takes; a KFP API that throttles
    _c("submit-host-ipv6-unclosed", "--host", "submit", "--host", "http://[::1",
       says="Invalid IPv6 URL"),
    _c("submit-host-port-range", "--host", "submit", "--host", "http://kfp:99999",
       says="Port out of range"),
    _c("submit-host-no-host", "--host", "submit", "--host", "http://:8080",
       says="names no host"),
    _c("schedule-host-ipv6-unclosed", "--host", "schedule", "--host", "http://[fe80::1",
       "--cron", "0 0 3 * * *", says="Invalid IPv6 URL"),
    _c("submit-throttled", "--host", "submit", "--host", "{throttled}",
       says="throttling requests (HTTP 429"),
    # 17. a relative path the pods would resolve in their own working directory
    _c("job-data-path-relative", "data.path", *RENDER, "--set", "data.path=data/corpus",
       says="relative path"),
    _c("trainjob-init-from-relative", "checkpoint.init_from", *TRAINJOB_NO_OUT, "--set",
       "checkpoint.init_from=models/m", says="relative path"),
    # 17. demo checks --steps and --fault before it writes the data
    _c("demo-steps-one", "--steps", "demo", "--out", "{ws}/demo", "--steps", "1"),
    _c("demo-fault-after-the-end", "--fault", "demo", "--out", "{ws}/demo", "--steps", "10",
       "--fault", "kill@25/1", says="after the last step (10)"),
    _c("demo-fault-rank", "--fault", "demo", "--out", "{ws}/demo", "--fault", "kill@3/5",
       says="ranks 0-1"),
    # 8. the run's own data.path is not here (a run made on the cluster): named as such
    _c("export-data-path-of-a-cluster-run", "data.path", "export", "--run-dir", "{fsxrun}",
       "--out", "{ws}/m", says="the run's data.path"),
]

COMPONENT_CASES = [  # (id, component, parameters, field the error must name)
    ("export-data-path-of-a-cluster-run", "export", {"run_path": "{fsxrun}"}, "data.path"),
    ("train-init-from-trailing", "train", {"init_from": "{sttrailing}"}, "init_from"),
]

_KEEP: list[object] = []  # the KFP API double lives as long as the sweep


def _special(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "file":
        path.write_text("not a folder")
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()


def _outputs(fx: Path) -> dict[str, str]:
    """Special files where an output goes; /dev/null itself for a user who may not mknod."""
    (fx / "io_target.txt").write_text("keep me")
    (fx / "io_file.txt").write_text("a file, not a folder")
    _special(fx / "out.fifo", "fifo")
    _special(fx / "out.sock", "socket")
    (fx / "out.link").symlink_to(fx / "io_target.txt")
    (fx / "out.dangling").symlink_to(fx / "io_nowhere")
    dev = "/dev/null"
    if os.geteuid() == 0:  # a private /dev/null: a regression replaces this one, not the host's
        dev = str(fx / "out.dev")
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return {"outfifo": str(fx / "out.fifo"), "outsock": str(fx / "out.sock"), "outdev": dev,
            "outlink": str(fx / "out.link"), "outdangling": str(fx / "out.dangling"),
            "iofile": str(fx / "io_file.txt")}


def _run_dirs(fx: Path) -> dict[str, str]:
    from kfp_nvrx.components.core.ownership import claim_run_dir

    out = {}
    for name, (entry, kind, _) in _RUN_DIRS.items():
        run = claim_run_dir(fx / "iorun" / name)
        _special(run / entry, kind)
        out[name] = str(run)
    for name, text in (("eventsempty", ""), ("eventsblank", "\n\n"),
                       ("eventsdamaged", '{"type": broken\n[1, 2]\n')):
        run = claim_run_dir(fx / "iorun" / name)
        (run / "events.jsonl").write_text(text)
        out[name] = str(run)
    return out


def _safetensors(fx: Path) -> dict[str, str]:
    out = {}
    for name, (header, body, _) in _SAFETENSORS.items():
        raw = json.dumps(header).encode()
        (fx / f"{name}.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
        out[name] = str(fx / f"{name}.safetensors")
    os.mkfifo(fx / "fifo.safetensors")
    return {**out, "stfifo": str(fx / "fifo.safetensors"), "strelabel": _relabelled(fx)}


def _relabelled(fx: Path) -> str:
    """The tiny preset's weights (zeros) whose first F32 tensor is labelled I32: same sizes."""
    import torch

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.training.model import build_model

    with torch.device("meta"):
        state = build_model(load_config("tiny").model).state_dict()
    header, offset = {}, 0
    for i, (key, t) in enumerate(state.items()):
        n = t.numel() * 4
        header[key] = {"dtype": "I32" if i == 0 else "F32", "shape": list(t.shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path = fx / "relabelled.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return str(path)


def _kubeconfigs(fx: Path) -> dict[str, str]:
    out = {}
    for name, (item, entry, _) in _KUBECONFIGS.items():
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
               "clusters": [{"name": "k", "cluster": {"server": HOST}}],
               "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
               "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
        doc[f"{item}s"][0][item].update(entry)
        (fx / f"{name}.yaml").write_text(json.dumps(doc))
        out[name] = str(fx / f"{name}.yaml")
    (fx / "nested.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")  # 10 kB
    return {**out, "kcnested": str(fx / "nested.yaml")}


def fixtures(fx: Path) -> dict[str, str]:
    """Special outputs, run dirs, safetensors and kubeconfigs; a KFP API that throttles."""
    throttled = KfpApiDouble(fail={("GET", "/apis/v2beta1/experiments"): (429, "slow down")})
    _KEEP.append(throttled.__enter__())  # noqa: PLC2801 - closed with the process
    # a run made on the cluster: its config.yaml records a data.path on /fsx
    recorded_run(fx / "fsxrun", "/fsx/kfp-nvrx-sweep/data/corpus")
    return {**_outputs(fx), **_run_dirs(fx), **_safetensors(fx), **_kubeconfigs(fx),
            "throttled": throttled.url, "fsxrun": str(fx / "fsxrun")}

