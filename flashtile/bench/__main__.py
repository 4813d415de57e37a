"""`python -m flashtile.bench ...`: the same as `python -m flashtile bench ...`."""
import sys

from . import main

sys.exit(main())
