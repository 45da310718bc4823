"""The run directory and the pipeline's stages: `rundir.RunDir` (load a trained run for any
consumer), `pipeline.Pipeline` (the stages), `staged` / `store` (stage caching), `validate` (the
configuration and input checks).

Nothing is imported here: `train.py` imports `run.validate` to check a configuration before jax
loads, and `RunDir` pulls in jax and the models (`from dspark_jax.run.rundir import RunDir`)."""
