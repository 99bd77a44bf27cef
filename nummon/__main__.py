"""`python -m nummon`: the command line."""

import sys

from ._cli import main

__all__: list[str] = []

sys.exit(main())
