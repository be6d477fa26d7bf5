"""``kfp-nvrx launch`` processes of the Kueue tests (tests/cluster/test_kueue.py).

Each is its own process, as KFP runs it, so a test can stop it with SIGTERM; what it prints goes
to a file under the cluster's folder (a pipe could fill), and ``--result`` writes its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The dataset every queued job trains on, under the shared volume.
DATA = "data/kueue-sample"
#: One launch on a loaded 2-core machine: generous, never the expected time.
RUN_S = 600.0


def prepare_data(cluster: Any) -> None:
    """The sample corpus on the shared volume, once per session."""
    from kfp_nvrx.components.data.prepare import prepare_dataset

    out = cluster.root / "volumes" / cluster.namespace / "kfp-nvrx-shared" / DATA
    if not out.is_dir():
        prepare_dataset("sample:400", out, seq_len=64)


@dataclass(frozen=True)
class LaunchArgs:
    """What one launch asks for: the job's name and API, and its queue, priority and extras."""

    name: str
    job_api: str
    steps: int
    queue: str = ""
    priority: str = ""
    extra: tuple[str, ...] = ()
    namespace: str = ""

    def argv(self, kube: Any, result: Path) -> list[str]:
        """The ``kfp-nvrx launch`` command line (``--result`` to ``result``)."""
        argv = [str(Path(sys.executable).parent / "kfp-nvrx"), "launch", "--backend",
                "kubernetes", "--job-api", self.job_api, "--name", self.name, "--namespace",
                self.namespace or kube.namespace, "--nodes", "2", "--instance-type", "cpu",
                "--cpu", "1", "--memory", "1Gi", "--image", "kfp-nvrx-trainer:test", "--pvc",
                "kfp-nvrx-shared", "--config", "tiny", "--poll-interval", "1",
                "--result", str(result), "--set", f"data.path=/fsx/{DATA}",
                f"train.steps={self.steps}", "checkpoint.interval=10"]
        if self.queue:
            argv += ["--queue-name", self.queue]
        if self.priority:
            argv += ["--priority-class", self.priority]
        return [*argv, *self.extra]


class Launch:
    """One ``kfp-nvrx launch --backend kubernetes`` of a 2-node CPU job (1 CPU per node)."""

    def __init__(self, kube: Any, args: LaunchArgs) -> None:
        self.kube, self.name = kube, args.name
        self.out = kube.root / f"launch-{args.name}-{time.monotonic_ns()}.log"
        self.err = self.out.with_suffix(".err")
        self.result_path = self.out.with_suffix(".json")
        argv = args.argv(kube, self.result_path)
        env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env,
                                         stdin=subprocess.DEVNULL)

    def text(self) -> str:
        """Everything it printed so far (stdout, then stderr)."""
        return self.out.read_text(errors="replace") + self.stderr()

    def stderr(self) -> str:
        """What it wrote to stderr."""
        return self.err.read_text(errors="replace")

    def lines(self) -> list[str]:
        """Its own lines (not the pods' ``[node-0]``/``[worker-0]`` lines)."""
        return [line for line in self.out.read_text(errors="replace").splitlines()
                if not line.startswith("[")]

    def wait_line(self, start: str) -> str:
        """Wait until it printed a line of its own starting with (or holding) ``start``."""
        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline:
            found = [line for line in self.lines() if line.startswith(start) or start in line]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"{self.name}: no line {start!r}:\n{self.text()[-3000:]}", pytrace=False)

    def wait(self) -> int:
        """Its exit status (stopped with SIGTERM, which deletes its job, if it hangs)."""
        try:
            return self.proc.wait(RUN_S)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.name} did not end:\n{self.text()[-3000:]}", pytrace=False)

    def stop(self) -> None:
        """SIGTERM (the launcher deletes its job), then wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def result(self) -> dict[str, Any]:
        """The ``--result`` JSON."""
        return json.loads(self.result_path.read_text())
