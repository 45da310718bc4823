"""The embedded demo (docs/ARCHITECTURE.md §8): its corpus generator, run by `train.py` on the
micro preset.

Not part of the library's training code: `dspark_jax.train` reads any conversation files.
"""
