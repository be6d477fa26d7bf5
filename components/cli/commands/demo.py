"""``kfp-nvrx demo``: the whole job on this machine with a tiny model and one injected fault."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the subcommand."""
    p = sub.add_parser("demo", help="prepare -> train on 2 local nodes with a fault -> export")
    p.add_argument("--out", default="runs/demo", help="where data, run dir and model go")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--fault", default=None,
                   help="fault to inject (default: kill rank 1 at 5/12 of --steps, kill@25/1 "
                   "for 60)")
    p.set_defaults(handler=_run)


def _checked(args: argparse.Namespace) -> str:
    """The fault to inject, after checking --steps and --fault (before anything is written).

    The default fault follows ``--steps``: a fixed ``kill@25/1`` refused ``--steps 10`` naming a
    ``--fault`` the user never gave, after the data had been written.
    """
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.faults import check_faults
    from kfp_nvrx.components.errors import UserError

    if args.steps < 2:
        raise UserError("--steps", f"must be >= 2 (a fault, then a step to recover into), got "
                        f"{args.steps}")
    fault = args.fault or f"kill@{max(1, args.steps * 5 // 12)}/1"
    interval = load_config("tiny").checkpoint.interval
    try:
        check_faults([fault], args.steps, interval, world_size=2)  # 2 nodes x 1 process
    except UserError as err:
        raise UserError("--fault", err.message) from None
    return fault


def _run(args: argparse.Namespace) -> int:
    from kfp_nvrx.components.core.ownership import reset_out_dir
    from kfp_nvrx.components.data.prepare import prepare_dataset, summary
    from kfp_nvrx.components.launch.jobspec.resolve import LOCAL, resolve
    from kfp_nvrx.components.launch.jobspec.spec import JobSpec
    from kfp_nvrx.components.launch.local.run import LocalRun
    from kfp_nvrx.components.training.export.consolidate import export_checkpoint

    fault = _checked(args)
    out = reset_out_dir(args.out, ("run", "model"), "--out")  # only a folder we made
    run_dir, data_dir, model_dir = out / "run", out / "data", out / "model"
    print("== 1/3 prepare-data (bundled sample corpus, byte tokenizer)")
    print(summary(prepare_dataset("sample:", data_dir, seq_len=64)))
    print(f"== 2/3 launch-local: 2 nodes x 1 process, tiny model, fault {fault}")
    spec = JobSpec(nodes="2", run_dir=str(run_dir), config="tiny", faults=[fault],
                   overrides=[f"data.path={data_dir}", f"train.steps={args.steps}"])
    res = LocalRun(resolve(spec, LOCAL)).run()
    if not res.succeeded:
        sys.stderr.write(f"demo: training {res.state}: {res.reason}\n")
        return 1
    print("== 3/3 export (newest committed checkpoint -> safetensors, eval loss)")
    info = export_checkpoint(run_dir, model_dir)
    g = res.summary
    assert g is not None  # a local run's events are always here
    rows = [
        ("state", res.state),
        ("steps", g.steps_final),
        ("wall time", f"{res.duration_s:.1f} s"),
        ("goodput", f"{res.goodput:.1%}"),
        ("restarts", res.restarts_text()),
        ("recovery (fault -> next step)", f"{res.recovery_s} s"),
        ("steps redone", g.steps_redone),
        ("checkpoint stall", f"{g.checkpoint_stall_s:.3f} s over {g.checkpoints} saves"),
        ("final train loss", g.final_loss),
        ("eval loss", info.get("eval_loss")),
        ("model", str(model_dir / "model.safetensors")),
    ]
    print("== summary")
    for key, value in rows:
        print(f"  {key:<30} {value}")
    return 0
