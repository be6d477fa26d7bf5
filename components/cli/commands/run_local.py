"""``kfp-nvrx run-local``: run a whole pipeline on this machine with ``kfp.local``.

Tasks run as subprocesses in the current Python environment (``SubprocessRunner(use_venv=False)``)
with the local training backend; Kubernetes settings (PVC, tolerations, timeouts) are ignored by
``kfp.local``, so ``workspace`` defaults to a local directory. Bad parameters, trainer config,
``--set`` overrides and faults are checked before the first task starts. At the end a summary
table shows goodput, recovery, eval loss and where the model and the timeline page are.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

#: Executor log lines that only repeat what the summary shows (``--verbose`` keeps them).
_NOISE = ("Looking for component `", "Wrote executor output file to ")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run-local`` subcommand."""
    p = subparsers.add_parser(
        "run-local",
        help="run a pipeline on this machine with kfp.local and the local training backend",
        description="Run fsdp-train or scheduled-retrain locally (kfp.local, subprocesses, local "
        "ft_launcher agents) and print a summary. Example (the demo): kfp-nvrx run-local "
        "--pipeline fsdp-train --param faults=kill@20/1",
    )
    p.add_argument("--pipeline", default="fsdp-train",
                   help="fsdp-train (default) or scheduled-retrain")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="pipeline parameter (repeatable); lists take JSON or a,b,c")
    p.add_argument("--out", default="runs/local",
                   help="local root: pipeline outputs under <out>/pipeline_root, datasets, runs "
                   "and models under <out>/workspace (default runs/local)")
    p.add_argument("--verbose", action="store_true",
                   help="show the KFP executor's own log lines (executor input JSON etc.)")
    p.set_defaults(handler=run)


def pipeline_spec_dict(pipeline: Any) -> dict[str, Any]:
    """Return the pipeline spec of a ``GraphComponent`` as a plain dict."""
    from google.protobuf import json_format

    return json_format.MessageToDict(pipeline.pipeline_spec)


def local_arguments(name: str, params: list[str], out: Path) -> dict[str, Any]:
    """Typed pipeline arguments for a local run; checks them without starting anything.

    Args:
        name: Pipeline name.
        params: Raw ``--param`` items.
        out: The ``--out`` directory (``workspace`` defaults to ``<out>/workspace``).

    Returns:
        The arguments to call the pipeline with.

    Raises:
        UserError: On unknown/ill-typed parameters, a non-local backend, a missing ``source``,
            or a bad trainer config, ``overrides``, ``faults`` or ``nodes``.

    """
    from kfp_nvrx.components.core.config import load_config
    from kfp_nvrx.components.core.faults import check_faults
    from kfp_nvrx.components.core.fields import PIPELINE
    from kfp_nvrx.components.data.prepare import SAMPLE_SCHEME
    from kfp_nvrx.components.data.sources import resolve_sources
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.launch.jobspec.spec import parse_nodes
    from kfp_nvrx.pipelines.compile import load_pipeline
    from kfp_nvrx.pipelines.params import parse_params, pipeline_parameters

    spec = pipeline_parameters(pipeline_spec_dict(load_pipeline(name)))
    args = parse_params(params, spec)
    args.setdefault("workspace", str((out / "workspace").absolute()))
    args.setdefault("backend", "local")  # the compiled default is kubernetes
    if args["backend"] != "local":
        raise UserError("--param backend", "run-local runs the local backend only; use "
                        "`kfp-nvrx submit` to train on Kubernetes")

    def value(key: str) -> Any:
        return args.get(key, spec.get(key, {}).get("defaultValue"))

    try:
        source = str(value("source"))
        if not source.strip().startswith(SAMPLE_SCHEME):
            resolve_sources(source)
        cfg = load_config(value("config"), list(value("overrides") or []))
        check_faults(list(value("faults") or []), cfg.train.steps, cfg.checkpoint.interval)
        parse_nodes(value("nodes"))
    except UserError as err:  # named as the pipeline parameter the user set
        raise PIPELINE.reword(err) from None
    return args


def without_retries(pipeline: Any) -> Any:
    """Return a copy of the pipeline whose tasks have no retry policy.

    ``kfp.local`` honours ``set_retry``; the cluster back-off (60 s, then 120 s) only delays a
    local failure, which is never transient.
    """
    local_copy = copy.deepcopy(pipeline)
    spec = local_copy.pipeline_spec
    dags = [spec.root.dag] + [c.dag for c in spec.components.values() if c.HasField("dag")]
    for dag in dags:
        for task in dag.tasks.values():
            task.ClearField("retry_policy")
    return local_copy


class _Filter(io.TextIOBase):
    """Drops the executor's input dump and bookkeeping lines from the streamed task output."""

    def __init__(self, target: Any) -> None:
        self.target, self.buf = target, ""
        self.skip_until: str | None = None  # inside the input dump: the line that ends it

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if self.skip_until is not None:
            if line.rstrip() == self.skip_until:
                self.skip_until = None
            return
        if "Got executor_input:" in line:
            indent = line[: len(line) - len(line.lstrip())]
            self.skip_until = indent + "}"
            return
        if not any(n in line for n in _NOISE):
            self.target.write(line + "\n")

    def flush(self) -> None:
        self.target.flush()


def _metrics(outputs: dict[str, Any], key: str) -> dict[str, Any]:
    art = outputs.get(key)
    return dict(getattr(art, "metadata", {}) or {})


def summary_rows(name: str, outputs: dict[str, Any], wall_s: float) -> list[tuple[str, str]]:
    """Rows of the summary table from a local run's pipeline outputs."""
    from kfp_nvrx.components.core.events import RESTART_LAYERS
    from kfp_nvrx.components.core.goodput import restarts_in_words
    from kfp_nvrx.components.launch.ui_outputs import restart_metric

    train = _metrics(outputs, "train_metrics")
    rows = [("pipeline", name), ("wall time", f"{wall_s:.1f} s")]
    if train:
        rows += [
            ("goodput", f"{100 * float(train.get('goodput', 0)):.1f}%"),
            ("steps", f"{int(train.get('steps_final', 0))} final, "
                      f"{int(train.get('steps_redone', 0))} redone"),
            ("restarts", restarts_in_words(int(train.get("restarts_total", 0)), {
                layer: int(train.get(restart_metric(layer), 0)) for layer in RESTART_LAYERS})),
            ("recovery", f"mean {float(train.get('recovery_mean_s', 0)):.2f} s, "
                         f"max {float(train.get('recovery_max_s', 0)):.2f} s"),
            ("checkpoint stall", f"{float(train.get('checkpoint_stall_s', 0)):.3f} s"),
        ]
        story = _metrics(outputs, "timeline").get("what_happened")
        if story:
            rows += [("" if i else "what happened", line)
                     for i, line in enumerate(story.split("; "))]
        if "final_loss" in train:
            rows.append(("final train loss", f"{float(train['final_loss']):.4f}"))
    evals = _metrics(outputs, "eval_metrics")
    if "eval_loss" in evals:
        rows.append(("eval loss", f"{float(evals['eval_loss']):.4f}"))
    decision = _metrics(outputs, "decision_metrics")
    if decision:
        rows.append(("decision", "promote" if decision.get("promote") else "keep"))
        rows.append(("candidate eval loss", f"{float(decision['candidate_eval_loss']):.4f}"))
        if "promoted_eval_loss" in decision:
            rows.append(("promoted eval loss", f"{float(decision['promoted_eval_loss']):.4f}"))
    for key, label in (("model", "model"), ("timeline", "timeline")):
        art = outputs.get(key)
        if art is not None:
            path = Path(art.uri)
            rows.append((label, str(path / "model.safetensors" if key == "model" else path)))
    return rows


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    """Run the pipeline locally and print the summary table."""
    from kfp import local

    from kfp_nvrx.components.core.atomic import check_output_folder
    from kfp_nvrx.pipelines.compile import check_name, load_pipeline

    name = check_name(args.pipeline)
    out = Path(args.out).absolute()
    check_output_folder(args.out, "--out")  # not /dev/null: found only by each task, failing
    arguments = local_arguments(name, args.param, out)
    local.init(runner=local.SubprocessRunner(use_venv=False),
               pipeline_root=str(out / "pipeline_root"), raise_on_error=True)
    start = time.time()
    stream = contextlib.nullcontext() if args.verbose else contextlib.redirect_stdout(
        _Filter(sys.stdout))
    try:
        with stream, warnings.catch_warnings():
            # kfp.local warns that our base image is not a stock Python image; locally the
            # tasks run in this environment, which has the package installed.
            warnings.filterwarnings("ignore", message=".*non-Python base image.*")
            warnings.filterwarnings("ignore", message=".*no effect in the current local runner.*")
            task = without_retries(load_pipeline(name))(**arguments)
    except RuntimeError as err:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()  # kfp colours its messages
        first = text.splitlines()[0] if text else type(err).__name__
        sys.stderr.write(f"kfp-nvrx run-local: {name} failed: {first} (the failing task's "
                         "output is above)\n")
        return 1
    print(f"\n{name} finished locally:")
    print(format_table(summary_rows(name, dict(task.outputs), time.time() - start)))
    return 0
