"""``python -m weightcache``: the ``strata weights`` commands (see :mod:`weightcache.cli`)."""

import sys

from weightcache.cli import main

sys.exit(main())
