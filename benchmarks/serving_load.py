"""Bounded load test of a running server on 127.0.0.1 (see dspark_jax/engine/server_load.py).

    python benchmarks/serving_load.py --url http://127.0.0.1:8000 --requests 1000

Prints one JSON object with latency percentiles, throughput per concurrency phase and a
`summary` (`valid_sent`, `valid_completed`, `server_5xx`, `leaked_slots`, `ok`); exits 1 unless
every check held.
"""

import sys

from dspark_jax.engine.server_load import main

if __name__ == "__main__":
    sys.exit(main())
