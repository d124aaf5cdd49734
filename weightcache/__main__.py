"""``python -m weightcache``: the ``strata weights`` commands (see :mod:`weightcache.cli`)."""

from weightcache.cli import run

run()
