"""The run directory: loading a trained run (`RunDir`)."""

from dspark_jax.run.rundir import RunDir

__all__ = ["RunDir"]
