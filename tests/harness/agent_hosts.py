"""The test cluster's network: one network namespace for its pods, and its DNS as a hosts file
the node agent bind-mounts on each pod's /etc/hosts.

Only processes the agent starts see either: name resolution and ports on the rest of the machine
are untouched. The namespace matters because every TrainJob's rendezvous store listens on
``0.0.0.0:29500`` (the torch plugin's fixed ``PET_MASTER_PORT``): two test clusters on one
machine (two engineers, a CI run) would otherwise reach each other's stores through 127.0.0.x.
The pods of one cluster share it (loopback, 127.0.0.0/8, one address per pod), as pods of a
cluster share a pod network. Unlike a pod network, it is one port space: two jobs running at once
in one test cluster meet at port 29500 (the second's store host joins the first's store), so the
tests run one training job at a time (a queued or finished one may overlap).
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from .procs import _die_with_parent


class Netns:
    """A network namespace kept alive by a sleeping holder process (dies with the agent)."""

    def __init__(self) -> None:
        # Started from the supervisor's main thread: PR_SET_PDEATHSIG follows that thread.
        self.holder = subprocess.Popen(
            ["unshare", "--net", "/bin/sh", "-c", "ip link set lo up && exec sleep infinity"],
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while b"sleep" not in self._cmdline():  # lo is up once the shell exec'd sleep
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("agent: could not make the pods' network namespace")
            time.sleep(0.05)

    def _cmdline(self) -> bytes:
        try:
            return Path(f"/proc/{self.holder.pid}/cmdline").read_bytes()
        except OSError:
            return b""

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net"]

    def stop(self) -> None:
        self.holder.kill()
        self.holder.wait(10)


class Hosts:
    """The cluster hosts file: the machine's own entries, then one line per DNS name.

    It is rewritten in place (never replaced): bind mounts pin the inode. Names only get added or
    re-pointed, and addresses are stable per name, so the file rarely changes under a reader.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.names: dict[str, str] = {}
        try:
            self.base = Path("/etc/hosts").read_text()
        except OSError:
            self.base = "127.0.0.1 localhost\n"
        path.write_text(self.base)

    def set(self, entries: dict[str, str]) -> None:
        """Point each name at its address (one write when anything changed)."""
        with self.lock:
            if all(self.names.get(n) == ip for n, ip in entries.items()):
                return
            self.names.update(entries)
            text = self.base + "".join(f"{ip} {n}\n" for n, ip in self.names.items())
            with open(self.path, "r+") as f:
                f.write(text)
                f.truncate()


def dns_names(host: str, sub: str, ns: str) -> list[str]:
    """``host[.sub]`` as a pod's resolver finds it: bare and with each search suffix."""
    base = f"{host}.{sub}" if sub else host
    return [base, f"{base}.{ns}", f"{base}.{ns}.svc", f"{base}.{ns}.svc.cluster.local"]
