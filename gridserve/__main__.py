"""``python -m gridserve ROLE ...``: the ``gridserve`` command (e.g. a Ray actor starting a worker)."""

import sys

from gridserve.cli import main

sys.exit(main())
