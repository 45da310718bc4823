"""The command lines: `train.py` (cli/train.py) and `serve.py` (cli/serve.py: generate; cli/serve_http.py:
serve / export; cli/bench.py: the load test). The scripts at the repository root only call `main`.

Importing this package and cli/common.py does not import jax: a configuration or flag mistake is
reported before jax loads."""
