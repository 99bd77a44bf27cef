"""`python -m nummon._watch PATH...` (the same as `nummon watch`)."""
import sys

from .command import main

sys.exit(main())
