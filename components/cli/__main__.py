"""``python -m kfp_nvrx.components.cli``: the same as the ``kfp-nvrx`` console script."""

import signal
import sys

# Ctrl-C while the interpreter imports the CLI stops it quietly (no traceback of an import);
# main() reports a Ctrl-C from then on.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from kfp_nvrx.components.cli.main import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main())
