"""The command lines: `train.py` (cli/train.py) and `serve.py` (cli/serve.py; cli/serve_http.py:
the flags of serve / bench / export; cli/serve_engine.py: generate, serve and export, which load a
model; cli/bench.py: the load test). The scripts at the repository root only call `main`.

Importing this package, cli/common.py, cli/train.py, cli/serve.py and cli/serve_http.py does not
import jax: a configuration or flag mistake is reported before jax loads."""
