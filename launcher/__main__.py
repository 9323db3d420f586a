"""python -m zero.launcher: zrun (the autotuner starts its trials this way)."""

import sys

from . import main

sys.exit(main())
