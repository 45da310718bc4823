"""Files shipped with the package (pyproject's package-data), read with importlib.resources:
decode_cost.json / decode_cost.tiny.json, copies of benchmarks/results' cost profiles (a ~42M-
parameter model and the tiny demo target), the server's fallback when a model has none."""
