"""The embedded demo (DESIGN §6): its corpus generator, run by `train.py` on the micro preset.

Not part of the library's training code: `dspark_jax.train` reads any conversation files.
"""
