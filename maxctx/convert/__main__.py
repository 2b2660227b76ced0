"""`python -m maxctx.convert`: see maxctx.convert.cli."""

import sys

from maxctx.convert.cli import main

sys.exit(main(sys.argv[1:]))
