"""``python -m fastanneal``: the same as the ``fastanneal`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
