"""One writer per run dir: the claim a job holds on the run dir it trains in.

``<run_dir>/.kfp-nvrx-writer.json`` names the job that writes the run dir now::

    {"holder": "k8s:team-a/llm-1b", "what": "job team-a/llm-1b", "pod": "llm-1b-node-0-0-x",
     "host": "ip-10-0-1-7", "pid": 1, "renewed": 1764853800.5, "lease_s": 60}

A job's pods and its launcher share one ``holder`` id: on Kubernetes ``k8s:<namespace>/<name>``
(a job's name is unique in its namespace while the job exists, so every pod of it, recreated or
restarted, is the holder; any other job, of any name or pipeline, is not). The claim is a lease:
each pod of the holder renews it every :data:`RENEW_S` while its trainer runs, and releases it
when it ends for good; a claim not renewed for its ``lease_s`` belongs to a job that is gone
(SIGKILLed, its node lost) and is taken over, so a stale claim never blocks for longer than the
lease. Where the launcher can see the volume it also asks the cluster: a holder whose job is gone
is no holder at all, and a job in use is refused before anything is created.

Every read-decide-write holds a POSIX lock on ``.kfp-nvrx-writer.lock`` (NFSv4, Lustre and local
file systems lock across nodes; where no lock is served the claim is still made, unlocked): two
jobs that start at one moment cannot both take it. Torch-free: the pods' entrypoint, the
launchers and the trainer's tools read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kfp_nvrx.components.core.bounded import JSON_LIMIT, parse_json, read_bytes
from kfp_nvrx.components.errors import UserError

CLAIM_FILE = ".kfp-nvrx-writer.json"
CLAIM_LOCK = ".kfp-nvrx-writer.lock"
_CLAIM_PREFIX = ".kfp-nvrx-writer."  # the claim, its lock and a torn write's temporary file
#: Seconds a claim stays the holder's without a renewal (environment: :data:`LEASE_ENV`).
LEASE_S = 60.0
LEASE_ENV = "KFP_NVRX_CLAIM_LEASE_S"
#: The longest lease a claim may have: a longer one (damaged, hostile) would block for good.
MAX_LEASE_S = 3600.0
#: The pods' environment naming the claim: the run dir and the holder id (set when rendered).
RUN_DIR_ENV = "KFP_NVRX_RUN_DIR"
HOLDER_ENV = "KFP_NVRX_RUN_HOLDER"
#: Seconds the lock on the claim is waited for (a read-decide-write holds it for milliseconds).
LOCK_WAIT_S = 10.0


def lease_s(env: dict[str, str] | os._Environ[str] | None = None) -> float:
    """The lease of the claims this process makes (:data:`LEASE_ENV`, else :data:`LEASE_S`)."""
    text = (os.environ if env is None else env).get(LEASE_ENV, "")
    try:
        value = float(text) if text else LEASE_S
    except ValueError:
        return LEASE_S
    return value if 1.0 <= value <= MAX_LEASE_S else LEASE_S


def kube_holder(namespace: str, name: str) -> str:
    """The holder id of the Kubernetes job ``name`` in ``namespace`` (its pods and launcher)."""
    return f"k8s:{namespace}/{name}"


@dataclass(frozen=True)
class Claim:
    """Who writes a run dir: the holder id, for people ``what`` and where, and the lease."""

    holder: str
    what: str
    pod: str = ""
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    renewed: float = field(default_factory=time.time)
    lease_s: float = LEASE_S

    def fresh(self, now: float | None = None) -> bool:
        """Renewed within its lease.

        A renewal up to one lease "in the future" (another node's clock runs ahead) counts; one
        further ahead is no renewal any clock made, and must not block the run dir for good.
        """
        now = time.time() if now is None else now
        return abs(now - self.renewed) < self.lease_s

    def describe(self, now: float | None = None) -> str:
        """``job ns/name (pod P on host H, renewed 12 s ago)`` for a refusal."""
        now = time.time() if now is None else now
        where = f"pod {self.pod} on host {self.host}" if self.pod else f"host {self.host} pid " \
                f"{self.pid}"
        return f"{self.what} ({where}, renewed {max(0.0, now - self.renewed):.0f} s ago)"


def _claim_of(raw: object) -> Claim | None:
    if not isinstance(raw, dict):
        return None
    try:
        claim = Claim(holder=str(raw["holder"]), what=str(raw.get("what", raw["holder"])),
                      pod=str(raw.get("pod", "")), host=str(raw.get("host", "")),
                      pid=int(raw.get("pid", 0)), renewed=float(raw["renewed"]),
                      lease_s=float(raw.get("lease_s", LEASE_S)))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    ok = claim.holder and math.isfinite(claim.renewed) and 0 < claim.lease_s <= MAX_LEASE_S
    return claim if ok else None


def read_claim(run_dir: str | os.PathLike[str]) -> Claim | None:
    """The run dir's claim; None when there is none or it is unreadable (a torn write).

    Raises:
        UserError: Naming ``run_dir`` when something other than a regular file is in its place
            (a link, a FIFO): never followed, never waited on.
    """
    path = Path(run_dir) / CLAIM_FILE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(mode):
        raise UserError("run_dir", f"{path} is no regular file (the run dir's writer claim); "
                        "remove it or use another `run_dir`")
    try:
        return _claim_of(parse_json(read_bytes(path, "run_dir", JSON_LIMIT, "writer claim"),
                                    "run_dir", path))
    except (OSError, UserError):
        return None


def _write(run_dir: Path, claim: Claim) -> None:
    tmp = run_dir / f"{CLAIM_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(asdict(claim)) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, run_dir / CLAIM_FILE)  # replaces a link in its place, never follows it


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """The claim's lock for one read-decide-write (unlocked where the file system has none)."""
    try:
        fd = os.open(run_dir / CLAIM_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except OSError as err:
        raise UserError("run_dir", f"{run_dir / CLAIM_LOCK} cannot be opened ({err.strerror}); "
                        "give a run dir on a writable volume") from None
    try:
        end = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    break  # no locks served here: the claim is made unlocked
                if time.monotonic() > end:
                    raise UserError("run_dir", f"{run_dir / CLAIM_LOCK} stayed locked for "
                                    f"{LOCK_WAIT_S:g} s; another job is taking the run dir") \
                        from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # drops the lock


def _ours(d: Path) -> bool:
    """Whether ``d`` is a run dir we may write the claim into; a new or empty one is marked ours.

    The claim comes before the trainer's first start: an empty run dir gets the run marker the
    start would write (else the claim's own files would make it "not empty and not a run dir").
    A folder holding anything else that is not ours is never written into: no claim is made
    there, and the trainer refuses the folder in its own words.
    """
    from kfp_nvrx.components.core.config import Config
    from kfp_nvrx.components.core.ownership import claim_run_dir, is_run_dir

    try:
        names = [n for n in os.listdir(d) if not n.startswith(_CLAIM_PREFIX)]
    except FileNotFoundError:
        names = []
    if not names:
        claim_run_dir(d)
        return True
    return is_run_dir(d, [f.name for f in dataclasses.fields(Config)], names)


def take(run_dir: str | os.PathLike[str], me: Claim,
         gone: Callable[[Claim], bool] | None = None) -> Claim | None:
    """Claims ``run_dir`` for ``me``; returns the other holder instead when it is in use.

    Taken when there is no claim, the claim is ``me``'s (a restarted pod, the launcher of the
    job), its lease ran out, or ``gone`` says its holder is gone (a launcher that asked the
    cluster). A new run dir is created and marked ours; a folder that is not a run dir of ours
    gets no claim (None: the trainer refuses it).
    """
    d = Path(run_dir)
    if not _ours(d):
        return None
    with _locked(d):
        cur = read_claim(d)
        if cur is not None and cur.holder != me.holder and cur.fresh() \
                and not (gone is not None and gone(cur)):
            return cur
        _write(d, replace(me, renewed=time.time()))
    return None


def renew(run_dir: str | os.PathLike[str], me: Claim) -> Claim | None:
    """Renews ``me``'s claim (taking it again when it was released); returns a new holder.

    A claim another job holds now (``me``'s lease ran out while this pod could not renew it, and
    that job took over) is not touched: it is returned, and ``me`` must stop writing.
    """
    d = Path(run_dir)
    if not _ours(d):
        return None
    with _locked(d):
        cur = read_claim(d)
        if cur is not None and cur.holder != me.holder:
            return cur
        _write(d, replace(me, renewed=time.time()))
    return None


def release(run_dir: str | os.PathLike[str], me: Claim) -> None:
    """Ends ``me``'s claim (nothing when another job holds the run dir now)."""
    d = Path(run_dir)
    with contextlib.suppress(OSError, UserError), _locked(d):
        cur = read_claim(d)
        if cur is not None and cur.holder == me.holder:
            (d / CLAIM_FILE).unlink()


def in_use(run_dir: str | os.PathLike[str], holder: Claim, field_name: str = "run_dir") \
        -> UserError:
    """The one-line refusal of a run dir ``holder`` writes."""
    return UserError(field_name, f"{run_dir} is in use by {holder.describe()}: one job writes a "
                     "run dir at a time; wait for that job to end (or delete it), or give "
                     "another run dir")


#: Renewals per lease (a pod that misses a few still holds the claim).
RENEWALS_PER_LEASE = 4
#: Seconds between two looks at a claim another job holds, while it is waited out.
POLL_S = 2.0


class PodClaim:
    """A pod's hold on its job's claim: taken before the trainer starts, renewed, released.

    Args:
        run_dir: The run dir the pod trains in.
        me: The claim this pod makes (its job's holder id).
        say: Where its one-line messages go (the pod's log).
    """

    def __init__(self, run_dir: str, me: Claim, say: Callable[[str], None]) -> None:
        self.run_dir, self.me, self.say = run_dir, me, say
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str],
                 say: Callable[[str], None]) -> PodClaim | None:
        """The claim a rendered pod makes (:data:`RUN_DIR_ENV`, :data:`HOLDER_ENV`); else None."""
        run_dir, holder = env.get(RUN_DIR_ENV, ""), env.get(HOLDER_ENV, "")
        if not run_dir or not holder:
            return None
        what = f"job {holder.removeprefix('k8s:')}"
        return cls(run_dir, Claim(holder=holder, what=what, pod=env.get("POD_NAME", ""),
                                  lease_s=lease_s(env)), say)

    def hold(self) -> str | None:
        """Takes the claim, waiting out another job's for up to one lease; the refusal, or None.

        A job that is gone stops renewing its claim: it runs out within its lease and is taken.
        One that renews it is writing the run dir: this pod does not start.
        """
        try:
            holder = take(self.run_dir, self.me)
            if holder is None:
                return None
            deadline = time.monotonic() + holder.lease_s + POLL_S
            self.say(f"{self.run_dir} is claimed by {holder.describe()}; waiting up to "
                     f"{holder.lease_s + POLL_S:.0f} s for that claim to end or run out")
            while holder is not None and time.monotonic() < deadline:
                time.sleep(POLL_S)
                holder = take(self.run_dir, self.me)
        except UserError as err:
            return err.message
        return None if holder is None else in_use(self.run_dir, holder).message

    def keep(self, on_lost: Callable[[Claim], None]) -> None:
        """Renews the claim in a daemon thread until :meth:`end`; ``on_lost``: another took it."""
        def renewals() -> None:
            while not self._stop.wait(self.me.lease_s / RENEWALS_PER_LEASE):
                try:
                    other = renew(self.run_dir, self.me)
                except (OSError, UserError):
                    continue  # the volume hiccuped: the next renewal tries again
                if other is not None:
                    on_lost(other)
                    return

        self._thread = threading.Thread(target=renewals, name="run-dir-claim", daemon=True)
        self._thread.start()

    def end(self, final: bool) -> None:
        """Stops renewing; releases the claim when the pod's exit is final (not restarted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=LOCK_WAIT_S + 1)
        if final:
            release(self.run_dir, self.me)
