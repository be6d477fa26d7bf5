"""The component image's extra alone, in a fresh venv, running what that image runs.

The component image installs ``kfp-nvrx[launcher]`` and nothing else (images/components/Dockerfile).
Here the wheel its build stage makes is installed with that extra, read from the Dockerfile, into a
new venv (pip's cache makes it quick; torch is never downloaded because nothing asks for it), and
the venv must: have no torch; import every launcher-side module; ``kfp-nvrx render-job`` a p5 job;
``kfp-nvrx compile`` exactly the shipped pipeline YAMLs; and run the KFP components whose
``base_image`` is the component image, the training step against the Kubernetes API test double
(tests/support/k8s_double.py) as a real cluster task would.

The trainer image's extras get the same treatment in tests/integration/test_images.py (``venv`` fixture).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from integration.test_images import DOCKERFILES, ROOT, replay_wheel_stage
from support.k8s_double import K8sDouble

from kfp_nvrx.components.launch.jobspec import naming

pytestmark = pytest.mark.slow

#: Launcher-side packages and modules: none may need torch. (trainer/, drills/ and the export and
#: compare code run in the trainer image.)
LAUNCHER_SIDE = [
    "kfp_nvrx.components.images",
    "kfp_nvrx.components.errors",
    "kfp_nvrx.components.core.ownership",
    "kfp_nvrx.components.core",
    "kfp_nvrx.components.train_fsdp.component",
    "kfp_nvrx.components.launch.ui_outputs",
    "kfp_nvrx.components.launch.jobspec",
    "kfp_nvrx.components.launch",
    "kfp_nvrx.components.prepare_dataset",
    "kfp_nvrx.components.export_checkpoint.component",
    "kfp_nvrx.components.evaluate_promote.component",
    "kfp_nvrx.components.training.export.promote",
    "kfp_nvrx.pipelines",
]

_IMPORT_ALL = """
import importlib, pkgutil, sys
names = sys.argv[1:]
done = []
for name in names:
    mod = importlib.import_module(name)
    done.append(name)
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
        importlib.import_module(info.name)
        done.append(info.name)
assert "torch" not in sys.modules, "a launcher-side module imported torch"
print(len(done))
"""

_COMPONENTS = """
import json, sys
from pathlib import Path
from kfp import dsl
from kfp_nvrx.components.prepare_dataset.component import prepare_dataset
from kfp_nvrx.components.train_fsdp.component import train_fsdp

fsx = Path(sys.argv[1])
def art(cls, name):
    return cls(name=name, uri=str(fsx / "art" / name), metadata={})
ds = art(dsl.Dataset, "dataset")
prepare_dataset.python_func(source="sample:50", workspace=str(fsx / "ws"), dataset=ds,
                            dataset_name="d", seq_len=32, val_fraction=0.1)
outs = {n: art(c, n) for n, c in (("run", dsl.Artifact), ("metrics", dsl.Metrics),
                                   ("timeline", dsl.HTML))}
train_fsdp.python_func(dataset=ds, workspace=str(fsx / "ws"), pvc_name="fsx",
                       mount_path=str(fsx), nodes="1", instance_type="p5.48xlarge",
                       backend="kubernetes", job_api="pytorchjob", kfp_run_id="run-venv",
                       kfp_task="train", **outs)
print(json.dumps({"run": outs["run"].metadata, "metrics": outs["metrics"].metadata}))
"""


def _dockerfile_extras(dockerfile: Path) -> str:
    """The extras the image's ``pip install`` of the kfp_nvrx wheel names."""
    (extras,) = re.findall(r"kfp_nvrx-\*\.whl\)\[([\w,]+)\]", dockerfile.read_text())
    return extras


@pytest.fixture(scope="module")
def launcher_venv(tmp_path_factory: pytest.TempPathFactory):
    """A fresh venv with the component image's wheel and extra (no --no-cache-dir: CI reuses it)."""
    base = tmp_path_factory.mktemp("launcher-venv")
    dockerfile = DOCKERFILES["components"]
    extras = _dockerfile_extras(dockerfile)
    assert extras == "launcher"
    wheel = replay_wheel_stage(dockerfile, base / "build")
    path = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    subprocess.run([str(path / "bin/python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", "--no-compile", f"{wheel}[{extras}]"],
                   check=True, timeout=600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(venv: Path, *argv: str, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=venv.parent,
                          env={"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(venv.parent),
                               **(env or {})})


def test_no_torch_and_every_launcher_module_imports(launcher_venv: Path) -> None:
    torch = _run(launcher_venv, "python", "-c", "import torch")
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    check = _run(launcher_venv, "python", "-m", "pip", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    imported = _run(launcher_venv, "python", "-c", _IMPORT_ALL, *LAUNCHER_SIDE)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert int(imported.stdout) > len(LAUNCHER_SIDE)


def test_render_job_for_p5(launcher_venv: Path) -> None:
    out = _run(launcher_venv, "kfp-nvrx", "render-job", "--instance-type", "p5.48xlarge",
               "--image", "r.example/team/kfp-nvrx-trainer:1", "--pvc", "fsx",
               "--config", "8b", "--nodes", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kind: PyTorchJob" in out.stdout and "--term-timeout=" in out.stdout


def test_compile_writes_the_shipped_pipelines(launcher_venv: Path, tmp_path: Path) -> None:
    out = _run(launcher_venv, "kfp-nvrx", "compile", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    shipped = sorted((ROOT / "pipelines/compiled").glob("*.yaml"))
    assert shipped and sorted(p.name for p in tmp_path.glob("*.yaml")) == [p.name for p in shipped]
    for path in shipped:
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name


def test_component_image_steps_run_against_the_api_double(launcher_venv: Path,
                                                          tmp_path: Path) -> None:
    fsx = tmp_path / "fsx"
    name = naming.derive_name("run-venv", "train")
    run_dir = fsx / "ws" / "runs" / name
    double = K8sDouble().serve()

    def operator() -> None:
        double.wait_for_job(name, timeout=120)
        w0 = double.add_pod(name, 0)
        double.start(w0)
        double.set_condition(name, "Running")
        # What the worker pods write on the shared volume: the run's events.
        run_dir.mkdir(parents=True, exist_ok=True)
        events = [{"type": "start", "time": 0.0, "incarnation": 0, "iteration": 0}]
        events += [{"type": "step", "step": n, "start": n - 1.0, "end": float(n), "time": float(n),
                    "incarnation": 0, "iteration": 0, "loss": 5.0 / n, "tokens": 64}
                   for n in (1, 2, 3)]
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        double.log(w0, "[trainer] step 3/3 loss 1.7")
        time.sleep(0.5)
        double.terminate(w0, 0)
        double.set_condition(name, "Succeeded")

    try:
        threading.Thread(target=operator, daemon=True).start()
        out = _run(launcher_venv, "python", "-c", _COMPONENTS, str(fsx),
                   env={"KUBECONFIG": str(double.write_kubeconfig(tmp_path / "kubeconfig"))})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        created = double.calls("POST", "pytorchjobs")
        assert len(created) == 1
        worker = created[0]["body"]["spec"]["pytorchReplicaSpecs"]["Worker"]
        container = worker["template"]["spec"]["containers"][0]
        assert container["image"].endswith(f"/kfp-nvrx-trainer:{_version(launcher_venv)}")
        assert "[worker-0] [trainer] step 3/3 loss 1.7" in out.stdout
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["run"]["path"] == str(run_dir) and result["run"]["state"] == "Succeeded"
        assert result["metrics"]["steps_final"] == 3
    finally:
        double.close()


def _version(venv: Path) -> str:
    out = _run(venv, "python", "-c", "import kfp_nvrx.components as c; print(c.__version__)")
    return out.stdout.strip()
