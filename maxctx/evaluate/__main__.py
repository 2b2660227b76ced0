"""`python -m maxctx.evaluate`: see maxctx.evaluate.cli."""

import sys

from maxctx.evaluate.cli import main

sys.exit(main(sys.argv[1:]))
