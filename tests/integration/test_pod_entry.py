"""The training container's entrypoint keeps Kubernetes' exit-code contract (issue 21.4)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

ENTRY = [sys.executable, "-m", "kfp_nvrx.components.core.pod_entry"]
#: Like ft_launcher: on SIGTERM it stops its "workers" and exits 1 (NVRx's main does).
FT_LIKE = ("import signal, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *a: (print('stopping', flush=True), "
           "sys.exit(1)))\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")


@pytest.mark.parametrize("script,code", [("raise SystemExit(0)", 0), ("raise SystemExit(1)", 1),
                                         ("raise SystemExit(93)", 93),
                                         ("import os; os.kill(os.getpid(), 9)", 137)])
def test_exit_status_passes_through(script: str, code: int) -> None:
    assert subprocess.run([*ENTRY, sys.executable, "-c", script], timeout=60).returncode == code


def test_sigterm_is_forwarded_and_reported_as_a_stop_not_a_verdict() -> None:
    p = subprocess.Popen([*ENTRY, sys.executable, "-c", FT_LIKE], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.stdout.readline().strip() == "stopping"  # the child got the signal and stopped
    assert p.wait(60) == 143  # not ft_launcher's 1: the pod was asked to stop


def test_missing_command_and_usage() -> None:
    assert subprocess.run([*ENTRY, "no-such-binary-kfp"], timeout=60).returncode == 127
    assert subprocess.run(ENTRY, timeout=60, capture_output=True).returncode == 2


def test_a_left_behind_grandchild_does_not_hold_it() -> None:
    """The entrypoint ends with its child, not with whatever the child left running."""
    import os

    line = "sleep 120 >/dev/null 2>&1 & echo $!; exit 4"
    out = subprocess.run([*ENTRY, "/bin/sh", "-c", line],
                         timeout=60, capture_output=True, text=True)
    os.kill(int(out.stdout.strip()), signal.SIGKILL)  # leave nothing running
    assert out.returncode == 4


def test_exit_codes_have_one_phrase_for_the_launcher() -> None:
    from kfp_nvrx.components.core.exits import exit_meaning

    assert "gave up" in exit_meaning(1) and "no training progress" in exit_meaning(93)
    assert "SIGKILL" in exit_meaning(137) and "SIGTERM" in exit_meaning(143)
    assert "rendezvous host" in exit_meaning(200)
    assert exit_meaning(0) == exit_meaning(None) == exit_meaning(42) == ""


#: ft_launcher's own verdict lines (its ``main``), as NVRx 0.4.1 and 0.7 write them.
GAVE_UP = ("[ERROR] Some rank(s) exited with non-zero exit code: {1: ProcessFailure(...)}. "
           "Agent's exit code = 1")
BROKE = ("[ERROR] Agent run ended with exception, e=RendezvousConnectionError('The connection "
         "to the C10d store has failed.'). Agent's exit code = 1")


def _entry(line: str, wait: str, **kw) -> subprocess.Popen:
    import os

    script = f"echo step 1; echo {line!r} >&2; exit 1"
    return subprocess.Popen([*ENTRY, "/bin/sh", "-c", script],
                            env={**os.environ, "KFP_NVRX_PEER_LOST_WAIT_S": wait},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_gave_up_passes_through_at_once_and_output_is_copied() -> None:
    p = _entry(GAVE_UP, "600")  # a peer-lost reading would wait 600 s: the timeout says so
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert out == "step 1\n" and err == GAVE_UP + "\n"  # each stream to its own, unchanged


def test_a_lost_peer_is_not_a_verdict() -> None:
    """ft_launcher's agent broke (store/rendezvous lost): 200, counted as infrastructure."""
    from kfp_nvrx.components.core.exits import PEER_LOST

    p = _entry(BROKE, "0")
    out, err = p.communicate(timeout=60)
    assert p.returncode == PEER_LOST == 200 and out == "step 1\n"
    assert err.startswith(BROKE + "\n") and "lost a peer pod" in err


def test_a_pod_that_lost_its_peer_waits_to_be_stopped() -> None:
    """The Job controller deletes it once the lost pod's failure is counted: 143, no verdict."""
    p = _entry(BROKE, "600")
    for line in p.stderr:  # a state, not a sleep: the entrypoint says it is waiting
        if "waiting up to 600 s" in line:
            break
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143


def test_a_1_without_a_verdict_line_stays_1() -> None:
    """ft_launcher died before its own verdict (an import error): nothing to re-read."""
    p = _entry("Traceback (most recent call last): ImportError", "600")
    p.communicate(timeout=60)
    assert p.returncode == 1


def test_peer_lost_wait_follows_the_pods_grace_period() -> None:
    from kfp_nvrx.components.core.exits import verdict
    from kfp_nvrx.components.core.launch_command import POD_STOP_MARGIN_S
    from kfp_nvrx.components.core.pod_entry import PEER_REPORT_S, peer_lost_wait_s
    from kfp_nvrx.components.core.pod_entry import POD_STOP_MARGIN_S as MARGIN

    assert MARGIN == POD_STOP_MARGIN_S  # the same margin pod_grace_period_s adds
    argv = ["ft_launcher", "--term-timeout=20", "-m", "trainer", "--term-timeout=999"]
    assert peer_lost_wait_s(argv, {}) == 20 + MARGIN + PEER_REPORT_S
    assert peer_lost_wait_s(["ft_launcher", "--term-timeout", "5"], {}) == 5 + MARGIN + 30
    assert peer_lost_wait_s(argv, {"KFP_NVRX_PEER_LOST_WAIT_S": "0"}) == 0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError):
            peer_lost_wait_s(argv, {"KFP_NVRX_PEER_LOST_WAIT_S": bad})
    assert verdict(1, "x\n" + BROKE + "\n") == 200 and verdict(1, GAVE_UP) == 1
    assert verdict(137, BROKE) == 137 and verdict(0, BROKE) == 0


def test_a_bad_wait_override_is_one_line_and_exit_2() -> None:
    import os

    out = subprocess.run([*ENTRY, "true"], env={**os.environ, "KFP_NVRX_PEER_LOST_WAIT_S": "x"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "KFP_NVRX_PEER_LOST_WAIT_S" in out.stderr


def _agents(tmp_path, nodes: int, worker: str) -> list[subprocess.Popen]:
    """``nodes`` real ft_launcher agents behind the entrypoint, as pods run them (node 0 hosts
    the c10d store), each in a process group of its own; their output goes to files."""
    import os
    import socket
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(worker)
    ft = str(Path(sys.executable).parent / "ft_launcher")
    env = {**os.environ, "KFP_NVRX_PEER_LOST_WAIT_S": "0", "PYTHONUNBUFFERED": "1"}
    procs = []
    for node in range(nodes):
        log = open(tmp_path / f"node{node}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(
            [*ENTRY, ft, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=pe", f"--nnodes={nodes}", "--nproc-per-node=1",
             "--max-restarts=3", "--local-addr=127.0.0.1",
             "--monitor-interval=0.1", "--workers-stop-timeout=5", "--term-timeout=5",
             "--ft-enable-nic-monitor=False", "--rdzv-conf", f"is_host={int(node == 0)}",
             str(script), str(tmp_path)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True))
        log.close()
    return procs


def _kill_all(tmp_path, procs) -> None:
    import os

    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(60)
    for f in tmp_path.glob("pid-*"):  # workers run in sessions of their own
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


SLEEPER = ("import os, sys, time\n"
           "d = sys.argv[1]\n"
           "open(f\"{d}/pid-{os.environ['RANK']}\", 'w').write(str(os.getpid()))\n"
           "time.sleep(300)\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_ft_launcher_losing_its_store_host_is_peer_lost(tmp_path) -> None:
    """NVRx's own agent: node 0 (the c10d store) SIGKILLed as a lost machine is; the survivor's
    ft_launcher exits 1 ("Agent run ended with exception"), its entrypoint 200, not a verdict.
    (Giving up keeps its 1: the TrainJob e2e test whose ft_launcher gives up fails at once.)"""
    import os
    import time

    procs = _agents(tmp_path, 2, SLEEPER)
    try:
        deadline = time.monotonic() + 240
        while not ((tmp_path / "pid-0").is_file() and (tmp_path / "pid-1").is_file()):
            assert time.monotonic() < deadline and procs[1].poll() is None, \
                (tmp_path / "node1.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(procs[0].pid, signal.SIGKILL)
        assert procs[1].wait(240) == 200, (tmp_path / "node1.log").read_text()[-3000:]
        assert "Agent run ended with exception" in (tmp_path / "node1.log").read_text()
    finally:
        _kill_all(tmp_path, procs)



def test_the_job_apis_read_its_codes_as_the_table_says() -> None:
    """200 and 143 are infrastructure for both APIs (the runtime's FailJob rule names 1..127
    only, ExitCode retries >= 128); only the PyTorchJob's pods skip the wait (any 1 fails it)."""
    import dataclasses

    from support.golden_specs import golden_specs
    from support.rendering import render_pytorchjob, render_trainjob

    from kfp_nvrx.components.core.exits import PEER_LOST, TERMINATED
    from kfp_nvrx.components.core.pod_entry import PEER_WAIT_ENV
    from kfp_nvrx.components.launch.trainjob.runtime import GAVE_UP_EXIT_CODES, build_runtime

    rules = build_runtime()["spec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["podFailurePolicy"]["rules"]
    fail = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]["values"]
    assert fail == GAVE_UP_EXIT_CODES and {1, 93} <= set(fail)
    assert PEER_LOST not in fail and TERMINATED not in fail and PEER_LOST >= 128
    spec = golden_specs("x", p5_nodes="2")["x_cpu.yaml"]

    def env(job: dict, path: list[str]) -> dict[str, str]:
        for key in path:
            job = job[key]
        return {e["name"]: e.get("value") for e in job}
    pj = render_pytorchjob(spec).to_dict()["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert env(pj, ["template", "spec", "containers", 0, "env"])[PEER_WAIT_ENV] == "0"
    tj = render_trainjob(spec).to_dict()["spec"]["trainer"]
    assert PEER_WAIT_ENV not in env(tj, ["env"])
    spec = dataclasses.replace(spec, env={**spec.env, PEER_WAIT_ENV: "30"})  # --env wins, once
    pj = render_pytorchjob(spec).to_dict()["spec"]["pytorchReplicaSpecs"]["Worker"]
    names = [e["name"] for e in pj["template"]["spec"]["containers"][0]["env"]]
    assert names.count(PEER_WAIT_ENV) == 1
    assert env(pj, ["template", "spec", "containers", 0, "env"])[PEER_WAIT_ENV] == "30"


def test_library_warnings_are_silenced_for_every_process_of_the_pod() -> None:
    """Every pod printed torch's pynvml FutureWarning, from each of its Python processes (30.8)."""
    import os

    warn = ("import warnings\n"
            "warnings.warn('The pynvml package is deprecated. Please install nvidia-ml-py', "
            "FutureWarning)\n"
            "warnings.warn('a warning of the run itself', FutureWarning)\n")
    grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {warn!r}])"
    env = {**os.environ, "PYTHONWARNINGS": "default::DeprecationWarning"}
    for script in (warn, grandchild):
        out = subprocess.run([*ENTRY, sys.executable, "-c", script], capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.returncode == 0 and "pynvml" not in out.stderr + out.stdout, out.stderr
        assert "a warning of the run itself" in out.stderr  # only the library's noise goes
