"""The ``kfp-nvrx`` command line: one module per subcommand under ``commands``."""
