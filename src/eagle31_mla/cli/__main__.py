"""``python -m eagle31_mla.cli``: the ``eagle31-mla`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
