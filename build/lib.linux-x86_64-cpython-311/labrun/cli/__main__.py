"""`python -m labrun.cli COMMAND`: the same as `labrun COMMAND`."""

import sys

from labrun.cli import main

sys.exit(main())
