"""``torchrun --nproc-per-node N -m eagle31_mla.train --target T --data DIR --out OUT ...``: ``eagle31-mla train``
as a module, for launchers that start modules (each rank runs it; see :mod:`eagle31_mla.training.distributed`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
