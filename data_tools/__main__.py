"""``python -m data_tools <command>``: the same commands as ``kvtrain data``."""

import sys

from data_tools.cli import main

sys.exit(main())
