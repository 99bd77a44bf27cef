"""`python -m nummon._watch PATH...` (the same as `nummon watch`)."""

import sys

from .command import main

__all__: list[str] = []

sys.exit(main())
