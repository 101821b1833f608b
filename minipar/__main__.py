"""`python -m minipar ...` is the `minipar` command (what `torchrun -m minipar` runs)."""

import sys

from minipar.console import main

sys.exit(main())
