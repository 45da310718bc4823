"""Host-side scheduling and calibration (numpy only, no model code).

* :mod:`~dspark_jax.sched.cost` - :class:`CostProfile`, the measured SPS(B) table with the engine's
  verification buckets, and its JSON format.
* :mod:`~dspark_jax.sched.policies` - verification-length policies behind one interface: fixed
  γ, static threshold, DSpark causal greedy (Algorithm 1) and the asynchronous top-K variant.
* :mod:`~dspark_jax.sched.sts` - Sequential Temperature Scaling of confidence logits.
"""

from dspark_jax.sched.cost import LAYOUTS, CostProfile
from dspark_jax.sched.policies import (
    AsyncTopK,
    CausalGreedy,
    FixedGamma,
    Policy,
    StaticThreshold,
    bucket_fill_count,
    causal_greedy_lengths,
    causal_greedy_reference,
    fixed_lengths,
    global_capacity,
    make_policy,
    survival,
    threshold_lengths,
    top_k_lengths,
)
from dspark_jax.sched.sts import STS, default_grid, fit_sts

__all__ = [
    "LAYOUTS",
    "STS",
    "AsyncTopK",
    "CausalGreedy",
    "CostProfile",
    "FixedGamma",
    "Policy",
    "StaticThreshold",
    "bucket_fill_count",
    "causal_greedy_lengths",
    "causal_greedy_reference",
    "default_grid",
    "fit_sts",
    "fixed_lengths",
    "global_capacity",
    "make_policy",
    "survival",
    "threshold_lengths",
    "top_k_lengths",
]
