"""`python -m cli` runs the `sluice` command (used by `sluice up` to start its children)."""

import sys

from cli.main import main

sys.exit(main())
