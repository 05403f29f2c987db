"""`python -m conveyor.kernels`: see conveyor/kernels/cli.py."""

import sys

from conveyor.kernels.cli import main

sys.exit(main())
