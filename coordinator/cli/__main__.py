"""``python -m coordinator.cli``: the same as the ``coordinator`` command."""

import sys

from coordinator.cli import main

sys.exit(main())
