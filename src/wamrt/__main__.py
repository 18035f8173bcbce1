"""`python -m wamrt`: the `wamrt` command."""

import sys

from .cli import main

sys.exit(main())
