"""``python -m hapc`` is the ``hapc`` command."""

import sys

from .cli import main

sys.exit(main())
