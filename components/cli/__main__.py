"""``python -m kfp_nvrx.components.cli``: the same as the ``kfp-nvrx`` console script."""

import sys

from kfp_nvrx.components.cli.main import main

sys.exit(main())
