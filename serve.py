#!/usr/bin/env python
"""Speculative generation and the OpenAI-compatible HTTP server: `python serve.py --help`; the
code is dspark_jax/cli/serve.py."""

import sys

from dspark_jax.cli.serve import main

if __name__ == "__main__":
    from dspark_jax.runtime import rerun_with_hugepages

    rerun_with_hugepages()  # once, before JAX is imported (dspark_jax/runtime.py)
    sys.exit(main())
