"""Where the pod entrypoint stops waiting for ft_launcher (issue 30 items 5 and 6).

* item 6: asked to stop, the rendezvous host's ft_launcher stopped its workers and then hung in
  its rendezvous shutdown until the pod's grace period ended; its peers waited on its store all
  along (PyTorchJob recovery 48 s against a TrainJob's 10-13 s). Its workers gone, it is killed.
* item 5: its workers succeeded, ft_launcher waited 300 s at the exit barrier for a peer whose
  pod was lost right after training ended. After the barrier's bound the pod exits 0.
* issue 38 item 7: a worker said the job's verdict (the restart budget spent) and SIGTERMed its
  ft_launcher, which lingered in its shutdown before it exited 1: 18-20 s from the verdict to the
  job's Failed. Its workers gone, it is killed and the pod exits 1 (the verdict) at once.

The stand-in for ft_launcher starts a worker (``-m kfp_nvrx_stand_in_worker`` on its command
line, as ft_launcher's workers carry the trainer module) and hangs where the real one does, for
far longer than any bound here: a pass never depends on how fast the machine is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ENTRY = [sys.executable, "-m", "kfp_nvrx.components.core.pod_entry"]
WORKER = ("import subprocess, sys\n"
          "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({w})', '-m',"
          " 'kfp_nvrx_stand_in_worker'])\n")
#: Stops its worker on SIGTERM, then hangs (the store host's rendezvous shutdown).
STORE_HOST = WORKER.format(w=600) + (
    "import signal, time\n"
    "def term(*_):\n"
    "    worker.terminate(); worker.wait()\n"
    "    print('Re-raising SignalException', flush=True)\n"
    "    time.sleep(300)\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "import os\n"
    "print('ready', os.getpid(), worker.pid, flush=True)\n"
    "while True:\n"
    "    time.sleep(1)\n")
#: Its worker says the job's verdict and SIGTERMs it (as the trainer's give_up does); it stops
#: the worker and lingers in its shutdown.
GIVES_UP = (
    "import os, signal, subprocess, sys, time\n"
    "def term(*_):\n"
    "    worker.terminate(); worker.wait()\n"
    "    time.sleep(300)\n"
    "    sys.exit(1)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "code = {code!r}\n"
    "worker = subprocess.Popen([sys.executable, '-c', code, '-m', 'kfp_nvrx_stand_in_worker'])\n"
    "print('ready', os.getpid(), worker.pid, flush=True)\n"
    "while True:\n"
    "    time.sleep(1)\n")
#: Its worker succeeds; then it waits at the exit barrier for an agent that never comes.
AT_BARRIER = WORKER.format(w=0.2) + (
    "import time\n"
    "worker.wait()\n"
    "print('[default] worker group successfully finished. Waiting 300 seconds for other agents"
    " to finish.', flush=True)\n"
    "time.sleep(300)\n")


def _gone(pid: int) -> bool:
    """No such process runs (a zombie left to an init that does not reap is no process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_stopped_rendezvous_host_ends_once_its_workers_are_gone() -> None:
    p = subprocess.Popen([*ENTRY, sys.executable, "-c", STORE_HOST, "--term-timeout=60"],
                         stdout=subprocess.PIPE, text=True)
    word, *pids = p.stdout.readline().split()
    assert word == "ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 143
    took = time.monotonic() - t0
    assert took < 60, took  # not the stand-in's 300 s hang, nor --term-timeout=60
    assert all(_gone(int(pid)) for pid in pids)  # ft_launcher's stand-in and its worker


def test_a_node_whose_workers_succeeded_does_not_wait_300_s_at_the_exit_barrier() -> None:
    env = {**os.environ, "KFP_NVRX_EXIT_BARRIER_S": "1"}
    t0 = time.monotonic()
    out = subprocess.run([*ENTRY, sys.executable, "-c", AT_BARRIER], env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 120
    assert "exit barrier" in out.stderr and out.stderr.count("pod_entry:") == 1


def test_a_verdict_ends_the_pod_once_its_workers_are_gone_not_when_ft_launcher_exits() -> None:
    from kfp_nvrx.components.core.rounds import Budget

    line = Budget(used=2, most=1).line()
    code = (f"import os, signal, sys, time; time.sleep(1); print({line!r}, file=sys.stderr, "
            "flush=True); os.kill(os.getppid(), signal.SIGTERM); time.sleep(600)")
    p = subprocess.Popen([*ENTRY, sys.executable, "-c", GIVES_UP.format(code=code),
                          "--term-timeout=60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        word, *pids = p.stdout.readline().split()
        assert word == "ready"
        t0 = time.monotonic()
        assert p.wait(timeout=120) == 1  # the verdict: final, never a restart's 137 or 143
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert took < 60, took  # not the stand-in's 300 s shutdown, nor --term-timeout=60
    assert all(_gone(int(pid)) for pid in pids)
    assert line in p.stderr.read()


def test_the_barrier_default_and_a_bad_override() -> None:
    from kfp_nvrx.components.core.pod_child import EXIT_BARRIER_S, exit_barrier_s, worker_module

    assert exit_barrier_s({}) == EXIT_BARRIER_S and exit_barrier_s({"KFP_NVRX_EXIT_BARRIER_S":
                                                                   "0"}) == 0
    out = subprocess.run([*ENTRY, "true"], env={**os.environ, "KFP_NVRX_EXIT_BARRIER_S": "soon"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert worker_module(["ft_launcher", "--x", "-m", "mod", "--run-dir", "r"]) == "mod"
    assert worker_module(["true"]) == ""


def test_the_agents_warm_process_is_no_worker_but_its_stand_ins_are() -> None:
    """The zygote runs a module below the trainer's and lives as long as the agent: a stop that
    waited for it would wait for the term timeout; the stand-ins ft_launcher started count."""
    from kfp_nvrx.components.core.launch_command import TRAINER_MODULE
    from kfp_nvrx.components.core.pod_child import Child

    agent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "sleep = [sys.executable, '-c', 'import time; time.sleep(600)', '-m']\n"
        f"z = subprocess.Popen([*sleep, '{TRAINER_MODULE}.zygote'])\n"
        f"w = subprocess.Popen([*sleep, '{TRAINER_MODULE}'])\n"
        "print(w.pid, flush=True)\n"
        "w.wait(); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stand_in = int(agent.stdout.readline())
        child = Child(agent.pid, ["agent", "-m", TRAINER_MODULE], 1.0, 1.0, lambda: False)
        assert child.workers_left()
        os.kill(stand_in, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while child.workers_left() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not child.workers_left()  # the zygote alone is left
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
