"""``python -m distrib ...``: the ``distrib`` command line (what ``distrib launch`` starts workers with)."""

import sys

from distrib.app.cli import main

sys.exit(main())
