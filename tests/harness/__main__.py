"""``python -m harness up|down|serve|status`` (run from tests/; ``make cluster-up`` does).

up      start a detached supervisor, wait until the cluster is ready, print the kubeconfig path
down    stop it, wait until no component process and no port of it is left
serve   the supervisor itself, in the foreground
status  print the state file
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import owner
from .controlplane import bin_dir
from .procs import alive, start_time, tail
from .supervisor import read_state, serve

DEFAULT_DIR = Path(os.environ.get("KFP_NVRX_CLUSTER_DIR")
                   or Path(tempfile.gettempdir()) / f"kfp-nvrx-cluster-{os.getuid()}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def up(root: Path, nodes: int, timeout_s: float) -> int:
    bins = bin_dir()
    if bins is None:
        print("cluster: no control-plane binaries; run `make cluster-bins` first (needs Go 1.26)",
              file=sys.stderr)
        return 2
    rec = owner.read_owner(root)
    if rec and rec.get("checkout") != str(owner.CHECKOUT):
        print(f"cluster: {root} is owned by a running cluster of another checkout "
              f"({owner.describe(rec)}); stop it from there with {owner.stop_hint(root)}, or "
              "give this one its own folder: make cluster-up CLUSTER_DIR=/tmp/another-folder",
              file=sys.stderr)
        return 2
    state = read_state(root)
    if state and alive(state.get("supervisor", -1)):
        print(f"cluster: already running in {root}; KUBECONFIG={state['kubeconfig']}; "
              f"stop with {owner.stop_hint(root)}")
        return 0
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "supervisor.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "serve", "--dir", str(root),
                             "--nodes", str(nodes)], cwd=Path(__file__).parent.parent,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(root)
        if state and state.get("supervisor") == proc.pid:
            if state.get("ready"):
                print(f"cluster: ready in {state['startup_s']} s")
                print(f"KUBECONFIG={state['kubeconfig']}")
                for claim, folder in sorted(state.get("volumes", {}).items()):
                    print(f"PVC {claim} -> {folder}")
                print(f"logs: {root / 'logs'}; stop with {owner.stop_hint(root)}")
                return 0
            if state.get("failed"):
                break
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    print(f"cluster: did not start; supervisor log {root / 'supervisor.log'}:\n"
          f"{tail(root / 'supervisor.log', 30)}", file=sys.stderr)
    proc.terminate()
    proc.wait(60)
    return 1


def down(root: Path, timeout_s: float = 120.0, any_owner: bool = False) -> int:
    rec = owner.read_owner(root)
    if rec and rec.get("checkout") != str(owner.CHECKOUT) and not any_owner:
        print(f"cluster: {root} is owned by a running cluster of another checkout "
              f"({owner.describe(rec)}); stop it from there, or here with --any-owner",
              file=sys.stderr)
        return 2
    state = read_state(root)
    if not state:
        shutil.rmtree(root / "etcd", ignore_errors=True)  # a crashed cluster's data goes too
        print(f"cluster: nothing running in {root}")
        return 0
    pid = state.get("supervisor", -1)
    comps = {n: (c["pid"], start_time(c["pid"])) for n, c in state["components"].items()}
    if alive(pid):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.25)
    left = [n for n, (p, st) in comps.items() if st is not None and alive(p, st)]
    for n in left:  # the supervisor could not stop them: stop them ourselves
        try:
            os.killpg(comps[n][0], signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    busy = [p for p in state.get("ports", []) if _port_open(p)]
    (root / "state.json").unlink(missing_ok=True)
    if not alive(pid):  # its etcd data would bring its objects (and pods) back in the next one
        shutil.rmtree(root / "etcd", ignore_errors=True)
    if alive(pid) or busy:
        print(f"cluster: stopped, but supervisor alive={alive(pid)} ports open={busy}",
              file=sys.stderr)
        return 1
    print(f"cluster: stopped (no process, no port left); logs in {root / 'logs'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness")
    ap.add_argument("command", choices=["up", "down", "serve", "status"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="run folder")
    ap.add_argument("--nodes", type=int, default=int(os.environ.get("CLUSTER_NODES", "2")),
                    help="test nodes run by the node agent (0: control plane only)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for `up`")
    ap.add_argument("--any-owner", action="store_true",
                    help="down: stop the cluster even when another checkout started it")
    a = ap.parse_args(argv)
    root = a.dir.resolve()
    if a.command == "up":
        return up(root, a.nodes, a.timeout)
    if a.command == "down":
        return down(root, any_owner=a.any_owner)
    if a.command == "status":
        print(json.dumps(read_state(root), indent=1))
        return 0
    bins = bin_dir()
    if bins is None:
        print("cluster: no binaries (make cluster-bins)", file=sys.stderr)
        return 2
    return serve(root, bins, a.nodes)


if __name__ == "__main__":
    sys.exit(main())
