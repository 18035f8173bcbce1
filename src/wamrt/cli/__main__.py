"""`python -m wamrt.cli`: the `wamrt` command."""

import sys

from . import main

sys.exit(main())
