"""``kfp-nvrx compile``: write the pipeline YAML that users upload in the Kubeflow UI."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``compile`` subcommand."""
    p = subparsers.add_parser(
        "compile",
        help="compile the pipelines to YAML (upload in the Kubeflow UI or submit)",
        description="Compile fsdp-train and scheduled-retrain to <out>/<name>.yaml. Component "
        "images are <registry>/kfp-nvrx-components:<package version>.",
    )
    p.add_argument("--out", default=None,
                   help="output directory (default: the package's pipelines/compiled/)")
    p.add_argument("--pipeline", action="append", default=None, metavar="NAME",
                   help="compile only this pipeline (repeatable; default: all)")
    p.add_argument("--registry", default=None,
                   help="image registry of the components (default: $KFP_NVRX_REGISTRY or "
                   "localhost:5000/kfp-nvrx)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Compile and print the written paths."""
    from kfp_nvrx.pipelines.compile import COMPILED_DIR, compile_pipelines

    for path in compile_pipelines(args.out or COMPILED_DIR, args.pipeline, args.registry):
        print(path)
    return 0
