"""The test cluster's DNS, as a hosts file the node agent bind-mounts on each pod's /etc/hosts.

Only processes the agent starts see it (their private mount namespace); name resolution on the
rest of the machine is untouched.
"""

from __future__ import annotations

import threading
from pathlib import Path


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
