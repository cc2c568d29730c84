"""``python -m tests.soak``: the adversarial soak of ``run.py`` (and, with ``--worker``, its subprocesses)."""

import sys

from .run import main

sys.exit(main())
