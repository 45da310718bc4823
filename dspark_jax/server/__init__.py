"""The OpenAI-compatible HTTP layer over the serving engine (`dspark_jax.engine`): the app and its
routes (`app.create_app`), one request's response (`request`), running uvicorn (`run`),
Prometheus metrics (`metrics`), strict request bodies and API errors (`protocol`), incremental
detokenization and stop strings (`text`). The engine does not import it."""
