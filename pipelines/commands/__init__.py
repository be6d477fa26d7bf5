"""CLI subcommands, one module each (see ``kfp_nvrx.pipelines.cli``)."""
