#!/usr/bin/env python
"""Speculative generation and the OpenAI-compatible HTTP server: `python serve.py --help`; the
code is dspark_jax/cli/serve.py."""

import sys

if __name__ == "__main__":
    from dspark_jax.runtime import rerun_with_hugepages

    rerun_with_hugepages()  # first: glibc reads the tunable only when a process starts (runtime/)
    from dspark_jax.cli.serve import main  # after the re-run: its imports take 0.36 s

    sys.exit(main())
