"""`python -m sluice_inference.cli` runs the `sluice` command (used by `sluice up` to start its children)."""

import sys

from sluice_inference.cli.main import main

sys.exit(main())
