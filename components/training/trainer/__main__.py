"""Worker entry point: ``ft_launcher ... -m kfp_nvrx.components.training.trainer --config ...``."""

from __future__ import annotations

import os
import time

_T_MAIN = time.time()  # this module starts running: the interpreter, site and runpy are done
# FT: in-process restart needs quiet c10d logs, set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from kfp_nvrx.components.core.ckpt_store import open_store  # noqa: E402
from kfp_nvrx.components.core.disk import disk_full, disk_full_line  # noqa: E402
from kfp_nvrx.components.core.fields import CLI  # noqa: E402
from kfp_nvrx.components.core.trainer_flags import (  # noqa: E402
    CONFIG_FLAG,
    RUN_DIR_FLAG,
    add_trainer_flags,
)
from kfp_nvrx.components.errors import UserError  # noqa: E402
from kfp_nvrx.components.training.trainer.handoff import process_start_time  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The trainer's flags (the same ones ``launch-local`` and the worker pods pass)."""
    p = argparse.ArgumentParser(prog="python -m kfp_nvrx.components.training.trainer",
                                description="FSDP2 trainer with NVRx fault tolerance.")
    add_trainer_flags(p, required=(CONFIG_FLAG, RUN_DIR_FLAG))
    # The launcher's preflight: every check a worker makes before training, without a launcher
    # environment and without writing the run dir; a UserError comes back as one JSON line.
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def boot_parts(t_exec: float | None, t_main: float, t_imported: float,
               prepared: dict[str, float], *, warm: bool = False) -> dict[str, float]:
    """Seconds of the start before the first incarnation, in order.

    ``interpreter``: process creation (``t_exec``) to this module (``t_main``): Python, site,
    runpy; absent off Linux. ``imports``: torch and the training modules, or ``handoff`` for a
    warm start (:mod:`.handoff`: this process's start handed to the agent's zygote, whose fork has
    them imported); then :func:`prepare_job`'s parts: ``checks`` (config, dataset, checkpoint,
    run dir), ``cuda_context`` (the device) and ``nvrx_client`` (NVRx import and its rank
    monitor client).
    """
    parts = {"interpreter": max(0.0, t_main - t_exec)} if t_exec else {}
    parts["handoff" if warm else "imports"] = t_imported - t_main
    return {**parts, **prepared}


def make_nccl_trace_dir() -> Path | None:
    """Create the folder of ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (the pod env points it into the run dir).

    torch's flight recorder writes ``<prefix><rank>`` on a collective timeout and does not create
    the folder, so without this the dumps that explain a hang are lost.
    """
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
    if not prefix:
        return None
    folder = Path(prefix).parent
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def main(argv: list[str] | None = None,
         clock: tuple[float | None, float, float] | None = None) -> int:
    """Validates inputs before any process group exists, then trains.

    Args:
        argv: The trainer's flags (default: this process's).
        clock: For a warm start (:mod:`.zygote`): when the stand-in process was created and
            began its ``__main__``, and when this fork took over; None for a cold start.
    """
    args = parse_args(argv)
    if not args.run_dir.strip():  # Path('') is '.': the working directory, never meant
        sys.stderr.write("trainer: error: --run-dir: is empty; give the run directory\n")
        return UserError.exit_code
    if args.check:
        from kfp_nvrx.components.training.trainer.bootstrap import check_job

        return check_job(args.config, args.overrides, args.faults, Path(args.run_dir))
    # The heavy imports first and on their own, so the start-up shows what they cost.
    import kfp_nvrx.components.training.trainer.train  # noqa: F401
    from kfp_nvrx.components.training.trainer.bootstrap import prepare_job

    t_exec, t_main, t_imported = clock or (process_start_time(), _T_MAIN, time.time())
    try:
        job = prepare_job(args.config, args.overrides, args.faults, Path(args.run_dir))
        make_nccl_trace_dir()
        job.booted(boot_parts(t_exec, t_main, t_imported, job.boot, warm=clock is not None),
                   min(t_exec or t_main, t_main))
    except OSError as err:
        if disk_full(err):  # config.yaml or the run dir on a full disk: say so, let it restart
            sys.stderr.write(f"[trainer] error: {disk_full_line(args.run_dir)}\n")
            return 1
        sys.stderr.write(f"trainer: error: TORCH_NCCL_DEBUG_INFO_TEMP_FILE: {err}\n")
        return UserError.exit_code
    except UserError as err:
        sys.stderr.write(f"trainer: error: {CLI.reword(err).one_line()}\n")
        return UserError.exit_code
    from kfp_nvrx.components.training.trainer.stopping import StopRequested
    from kfp_nvrx.components.training.trainer.train import run

    try:
        run(job)
    except StopRequested as stop:  # FT: the node was stopped; its save is over
        print(stop, file=sys.stderr, flush=True)
        return 0 if stop.asked else 1
    except UserError as err:
        sys.stderr.write(f"trainer: error: {CLI.reword(err).one_line()}\n")
        return UserError.exit_code
    except Exception as err:
        where = Path(open_store(job.run_dir, job.cfg.checkpoint.store).where)
        if disk_full(err, where):
            # One line instead of torch's "inline_container.cc ... unexpected pos" traceback;
            # exit 1 so the launcher restarts the workers, which resume once there is room.
            sys.stderr.write(f"[trainer] error: {disk_full_line(where)}\n")
            return 1
        # One line in the log a user reads (a rank whose peer died fails in a collective with
        # a page of torch internals); the whole traceback is kept in the run's logs.
        sys.stderr.write(failure_line(err, job.run_dir) + "\n")
        return 1
    finally:
        job.monitor.close()
    return 0


def failure_line(err: BaseException, run_dir: Path) -> str:
    """``[trainer] rank R failed: Type: first line (traceback: <run_dir>/logs/...)``.

    The traceback goes to ``<run_dir>/logs/traceback-rank<R>-<pid>.txt`` (at most 64 KiB; not
    through a link); where that cannot be written, it is printed after the line as before.
    """
    import traceback

    from kfp_nvrx.components.core.rundir import LOGS_DIR, refuse_link

    rank = os.environ.get("RANK", "?")
    first = (str(err).strip().splitlines() or [""])[0][:300]
    text = "".join(traceback.format_exception(err))[-(64 << 10):]
    path = Path(run_dir) / LOGS_DIR / f"traceback-rank{rank}-{os.getpid()}.txt"
    try:
        refuse_link(path, run_dir)
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        kept = f"traceback: {path}"
    except (OSError, UserError):
        sys.stderr.write(text)
        kept = "traceback above"
    if _PEER_LOST.search(text):  # a consequence, not the cause: say where to look
        return (f"[trainer] rank {rank} lost a peer rank in a collective ({first[:160]}); the "
                f"failed rank's own lines say why ({kept})")
    return f"[trainer] rank {rank} failed: {type(err).__name__}: {first} ({kept})"


#: How a collective reports a peer that died (gloo, NCCL, the c10d store).
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker "
                        r"crash|NCCL communicator was aborted|DistNetworkError|Broken pipe")


if __name__ == "__main__":  # required: NVRx's checkpoint worker is started with spawn
    # FT: a warm start when the agent keeps a zygote (resilience.warm_start), else a cold one.
    from kfp_nvrx.components.training.trainer.handoff import hand_off

    code = hand_off(sys.argv, _T_MAIN)
    sys.exit(main() if code is None else code)
