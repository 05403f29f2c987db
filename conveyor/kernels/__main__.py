"""`python -m conveyor.kernels --arch LEVEL [--cxx COMPILER]`: compile-check the kernels (CI)."""

import sys

from conveyor.kernels.build import main

sys.exit(main())
