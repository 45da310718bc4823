"""Pure math of speculative decoding: sampling transforms, exact chain verification, metrics.

Depends on jax / numpy only (no model code), so research code can import it alone.

* :mod:`~dspark_jax.spec.sampling` - logits -> the exact sampling distribution (temperature,
  top-k, top-p, min-p as per-row arrays; greedy as a static mode) and host-side validation.
* :mod:`~dspark_jax.spec.verify` - jitted rejection-sampling verification of a chain of drafts
  (``from dspark_jax.spec.verify import verify``; the package does not re-export the name
  ``verify`` so that it keeps naming the module).
* :mod:`~dspark_jax.spec.rng` - the (stream, request seed, position) key convention.
* :mod:`~dspark_jax.spec.metrics` - τ, conditional acceptance vs prefix survival, verify rate,
  ECE / AUROC / Brier of confidences.
"""

from dspark_jax.spec.metrics import (
    AcceptanceStats,
    Reliability,
    acceptance_stats,
    auroc,
    brier,
    conditional_acceptance,
    cumulative_survival,
    ece,
    prefix_labels,
    prefix_survival,
    reliability,
    reliability_from_logits,
)
from dspark_jax.spec.rng import ACCEPT, DRAFT, SAMPLE, RequestRng, position_keys, stream_key
from dspark_jax.spec.sampling import (
    SamplingConfig,
    SamplingParams,
    check_logits,
    probs_from_logits,
    sample_from_logits,
    sample_from_probs,
    transform_logits,
    validate_sampling_params,
)
from dspark_jax.spec.verify import (
    acceptance_prob,
    residual_dist,
    verify_core,
    verify_distributions,
)

__all__ = [
    "ACCEPT",
    "DRAFT",
    "SAMPLE",
    "AcceptanceStats",
    "Reliability",
    "RequestRng",
    "SamplingConfig",
    "SamplingParams",
    "acceptance_prob",
    "acceptance_stats",
    "auroc",
    "brier",
    "check_logits",
    "conditional_acceptance",
    "cumulative_survival",
    "ece",
    "position_keys",
    "prefix_labels",
    "prefix_survival",
    "probs_from_logits",
    "reliability",
    "reliability_from_logits",
    "residual_dist",
    "sample_from_logits",
    "sample_from_probs",
    "stream_key",
    "transform_logits",
    "validate_sampling_params",
    "verify_core",
    "verify_distributions",
]
