"""``kfp-nvrx schedule``: a recurring run of a compiled pipeline on a cron schedule."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schedule`` subcommand."""
    from kfp_nvrx.components.cli.commands.submit import add_connection_args

    p = subparsers.add_parser(
        "schedule",
        help="create a recurring run (cron) of a compiled pipeline on Kubeflow Pipelines",
        description="Create a recurring run via kfp.Client. The cron expression has 6 fields, "
        "seconds first: '0 0 3 * * *' runs at 03:00:00 every day.",
    )
    add_connection_args(p, pipeline="scheduled-retrain")
    p.add_argument("--cron", required=True, help="6-field cron, seconds first, e.g. '0 0 3 * * *'")
    p.add_argument("--max-concurrency", type=int, default=1,
                   help="runs of this schedule allowed at once, 1-10 (default 1)")
    p.add_argument("--no-catchup", action="store_true",
                   help="skip intervals missed while paused instead of back-filling them")
    p.add_argument("--name", default=None,
                   help="display name of the recurring run (default: pipeline name)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Validate, create the recurring run and print its id and link."""
    from kfp_nvrx.components.cli.commands.submit import package_for, prepare
    from kfp_nvrx.components.errors import UserError
    from kfp_nvrx.pipelines import client as kc

    cron = kc.validate_cron(args.cron)  # before connecting: bad input never reaches the API
    if not 1 <= args.max_concurrency <= kc.MAX_CONCURRENCY:
        raise UserError("--max-concurrency", f"must be within 1-{kc.MAX_CONCURRENCY}, got "
                        f"{args.max_concurrency}")
    with package_for(args) as package:
        arguments, api = prepare(args, package)
        info = kc.schedule(api, package,
                           kc.Recurrence(cron, args.max_concurrency, args.no_catchup),
                           arguments=arguments, experiment=args.experiment,
                           name=args.name or args.pipeline)
    print(f"scheduled {args.pipeline} ({cron}) as recurring run {info['recurring_run_id']} in "
          f"experiment {args.experiment}: {info['url']}")
    return 0
