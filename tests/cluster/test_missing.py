"""A missing PVC or Secret fails the launch in one bounded line (issue 30 item 7).

Real scheduler ("persistentvolumeclaim ... not found") and the node agent's kubelet wording
(``CreateContainerConfigError``: 'secret "..." not found'). Before, a PyTorchJob showed one
"not scheduled" line and then nothing until its deadline (7 days by default).
"""

from __future__ import annotations

import time

import pytest
from harness.launch_real import Cli, cli_args, leftovers

pytestmark = [pytest.mark.timeout(600)]
#: --missing-grace: the default (60 s) would only make the test wait longer.
GRACE_S = 10


@pytest.mark.parametrize(("job_api", "flag", "value", "field"), [
    ("pytorchjob", "--pvc", "no-such-claim", "--pvc"),
    ("trainjob", "--pvc", "no-such-claim", "--pvc"),
    ("pytorchjob", "--secret-env", "TOKEN=no-such-secret:token", "--secret-env")])
def test_a_missing_object_is_said_while_waiting_then_one_line(kube, tmp_path, job_api, flag,
                                                               value, field):
    name = f"missing-{job_api[:2]}-{field.strip('-')[:3]}"
    t0 = time.monotonic()
    cli = Cli(cli_args(name, job_api, "run-real", flag, value, "--missing-grace", str(GRACE_S)),
              kube.kubeconfig, tmp_path)
    cli.wait_line("warning: the pods wait for ")
    said = next(line for line in cli.out if "warning: the pods wait for " in line)
    assert ("no-such-claim" if flag == "--pvc" else "no-such-secret") in said, said
    assert cli.wait(GRACE_S + 180) == 2, cli.out[-20:]
    took = time.monotonic() - t0
    lines = cli.stderr().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kfp-nvrx launch: error: {field}: "), lines
    assert "does not exist in namespace" in lines[0] and "the job was deleted" in lines[0]
    assert took >= GRACE_S, took  # the object may still be created meanwhile
    assert took < GRACE_S + 150, took  # bounded: not the job's 7-day deadline
    assert leftovers(kube.client(), kube.namespace, name) == {}
