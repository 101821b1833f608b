"""`python -m exercises 01` is `python -m exercises.check 01`."""

import sys

from exercises.check import main

sys.exit(main())
