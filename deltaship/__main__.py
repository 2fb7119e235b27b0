"""`python -m deltaship ...` is the `deltaship` command."""

import sys

from deltaship.cli import main

sys.exit(main())
