#!/usr/bin/env python
"""dspark-jax pipeline (data → train → calibrate → evaluate): `python train.py --help`; the code
is dspark_jax/cli/train.py."""

import sys

from dspark_jax.cli.train import main

if __name__ == "__main__":
    from dspark_jax.runtime import rerun_with_hugepages

    rerun_with_hugepages()  # once, before JAX is imported (dspark_jax/runtime/)
    sys.exit(main())
