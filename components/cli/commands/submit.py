"""``kfp-nvrx submit``: start one run of a compiled pipeline on a Kubeflow Pipelines API."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfp_nvrx.pipelines.client import KfpApi


def add_connection_args(p: argparse.ArgumentParser, pipeline: str = "fsdp-train") -> None:
    """Add the flags shared by ``submit`` and ``schedule``."""
    p.add_argument("--host", required=True,
                   help="KFP API base URL, e.g. http://localhost:8080 (kubectl -n kubeflow "
                   "port-forward svc/ml-pipeline-ui 8080:80)")
    p.add_argument("--pipeline", default=pipeline,
                   help=f"fsdp-train or scheduled-retrain (default {pipeline})")
    p.add_argument("--package", default=None,
                   help="compiled pipeline YAML to send instead of the shipped one")
    p.add_argument("--registry", default=None,
                   help="compile the pipeline for images in this registry before sending it "
                   "(also done when $KFP_NVRX_REGISTRY is set); default: the shipped YAML, "
                   "which names localhost:5000/kfp-nvrx images")
    p.add_argument("--experiment", default="kfp-nvrx",
                   help="experiment name, created when missing (default kfp-nvrx)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="pipeline parameter (repeatable); lists take JSON or a,b,c")
    p.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user)")
    p.add_argument("--token-file", default=None,
                   help="file holding a bearer token for the API (e.g. a service-account token)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds each API request may take (default 60)")


@contextlib.contextmanager
def package_for(args: argparse.Namespace) -> Iterator[str]:
    """Yield the pipeline YAML to send: ``--package``, a fresh compile, or the shipped file."""
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.components.images import REGISTRY_ENV
    from kfp_nvrx.pipelines.compile import check_name, compile_pipelines, compiled_path

    check_name(args.pipeline)
    if args.package:
        if args.registry:
            raise UserError("--registry", "cannot re-target a given --package; compile it with "
                            "`kfp-nvrx compile --registry` instead")
        yield args.package
    elif args.registry or os.environ.get(REGISTRY_ENV, "").strip():
        with tempfile.TemporaryDirectory(prefix="kfp-nvrx-compile-") as tmp:
            (path,) = compile_pipelines(tmp, [args.pipeline], args.registry)
            yield str(path)
    else:
        yield str(compiled_path(args.pipeline))


def prepare(args: argparse.Namespace, package: str) -> tuple[dict, KfpApi]:
    """Check the parameters against ``package``, then connect: (arguments, api)."""
    import math

    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.pipelines import client as kc
    from kfp_nvrx.pipelines.params import load_package, parse_params, pipeline_parameters

    arguments = parse_params(args.param, pipeline_parameters(load_package(package)))
    kc.normalize_host(args.host)
    token = kc.read_token(args.token_file)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UserError("--timeout", f"must be a number of seconds > 0, got {args.timeout}")
    return arguments, kc.KfpApi(args.host, token=token, namespace=args.namespace,
                                timeout=args.timeout)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``submit`` subcommand."""
    p = subparsers.add_parser(
        "submit",
        help="start a run of a compiled pipeline on Kubeflow Pipelines",
        description="Submit the shipped compiled pipeline (or --package) as one run via "
        "kfp.Client. Parameters are checked against the pipeline before anything is sent.",
    )
    add_connection_args(p)
    p.add_argument("--run-name", default=None, help="display name (default: pipeline + time)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Submit and print the run id and link."""
    from kfp_nvrx.pipelines import client as kc

    with package_for(args) as package:
        arguments, api = prepare(args, package)
        name = args.run_name or f"{args.pipeline} {dt.datetime.now():%Y-%m-%d %H:%M:%S}"
        info = kc.submit(api, package, arguments=arguments, experiment=args.experiment,
                         run_name=name)
    print(f"submitted {args.pipeline} run {info['run_id']} in experiment {args.experiment}: "
          f"{info['url']}")
    return 0
