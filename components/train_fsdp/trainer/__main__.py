"""Worker entry point: ``ft_launcher ... -m kfp_nvrx.components.train_fsdp.trainer --config ...``."""

from __future__ import annotations

import os

# FT: in-process restart needs quiet c10d logs, set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from kfp_nvrx.components.errors import UserError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The trainer's flags (the same ones ``launch-local`` and the PyTorchJob pass)."""
    p = argparse.ArgumentParser(prog="python -m kfp_nvrx.components.train_fsdp.trainer",
                                description="FSDP2 trainer with NVRx fault tolerance.")
    p.add_argument("--config", required=True, help="preset (tiny, 125m, 1b, 8b) or YAML path")
    p.add_argument("--run-dir", required=True, help="run directory (checkpoints, events)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@STEP[/RANK]",
                   help="inject a fault once per run: kill, raise, hang, kill-in-ckpt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Validates inputs before any process group exists, then trains."""
    args = parse_args(argv)
    try:
        from kfp_nvrx.components.train_fsdp.trainer.setup import prepare_job

        job = prepare_job(args.config, args.set, args.fault, Path(args.run_dir))
    except UserError as err:
        sys.stderr.write(f"trainer: error: {err.one_line()}\n")
        return UserError.exit_code
    from kfp_nvrx.components.train_fsdp.trainer.train import run

    try:
        run(job)
    except UserError as err:
        sys.stderr.write(f"trainer: error: {err.one_line()}\n")
        return UserError.exit_code
    finally:
        job.monitor.close()
    return 0


if __name__ == "__main__":  # required: NVRx's checkpoint worker is started with spawn
    sys.exit(main())
