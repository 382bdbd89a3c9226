"""``python -m infinijup.store``: the store's command line."""

import sys

from .cli import main

sys.exit(main())
