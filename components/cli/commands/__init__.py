"""CLI subcommands, one module each (see ``kfp_nvrx.components.cli.main``)."""
