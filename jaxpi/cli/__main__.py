"""`python -m jaxpi.cli ...`: the same as the `jaxpi` console script."""

import sys

from jaxpi.cli import main

sys.exit(main())
