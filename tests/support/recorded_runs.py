"""Run dirs of ours for the bad-input sweep: config.yaml records the tiny preset, step 4 committed."""

from __future__ import annotations

import os
from pathlib import Path


def recorded_run(run_dir: Path, data_path: str, damaged: bool = False) -> None:
    """Records tiny with ``data.path=data_path`` in ``run_dir`` and commits step 4 (CRC32s).

    With ``damaged`` the step's biggest shard is then cut in half (its CRC32 no longer holds).
    """
    import torch.distributed.checkpoint as dcp

    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.run_record import record_config
    from kfp_nvrx.components.core.rundir import step_dir, write_commit_marker
    from kfp_nvrx.components.training.model import build_model

    cfg = load_config("tiny", [f"data.path={data_path}"])
    record_config(cfg, run_dir)
    path = step_dir(run_dir / "checkpoints", 4)
    path.mkdir(parents=True)
    dcp.save({"model": build_model(cfg.model).state_dict()},
             storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    write_commit_marker(path, 4, 1)
    if damaged:
        biggest = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(biggest, biggest.stat().st_size // 2)
