"""Entry point: ``python -m benchmarks [--only 1,4,7] [--size small|L|L-large] [--reps N] [--out PATH]``."""

import sys

from .cli import main

sys.exit(main())
