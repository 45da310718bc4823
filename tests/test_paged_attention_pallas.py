"""The reference Pallas kernel (interpret mode) == the pure-JAX paged attention, alone and inside
the paged target forward."""

import numpy as np
import pytest

from dspark_jax.models import paged_attention_pallas  # noqa: F401  (registers the impl)
from dspark_jax.models.paged import init_paged_cache, paged_forward_jit
from dspark_jax.models.paged_attention import paged_attention
from dspark_jax.testing import random_params, tiny_target_config
from tests.test_paged_attention import REQS, _case, _dense


@pytest.mark.parametrize(
    "nq,nkv,window,softcap",
    [(4, 2, None, None), (2, 2, None, None), (4, 1, 6, None), (4, 2, 5, 2.0)],
)
def test_pallas_kernel_equals_xla(nq, nkv, window, softcap):
    q, kp, vp, tables, kv_lens, cu, k_dense, v_dense = _case(nq, nkv)
    kw = dict(q_per_req=4, window=window, softcap=softcap)
    got = np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, impl="pallas_interpret", **kw))
    xla = np.asarray(paged_attention(q, kp, vp, tables, kv_lens, cu, **kw))
    assert np.abs(got - xla).max() <= 1e-5
    assert np.abs(got - _dense(q, k_dense, v_dense, REQS, window, softcap)).max() <= 1e-5
    assert not got[sum(ql for _, ql in REQS) :].any()
    with pytest.raises(ValueError, match="q_per_req"):
        paged_attention(q, kp, vp, tables, kv_lens, cu, impl="pallas_interpret")


def test_paged_forward_with_the_pallas_kernel():
    cfg = tiny_target_config()
    params = random_params(cfg, 3)
    rng = np.random.default_rng(0)
    tables = rng.permutation(24)[:16].reshape(2, 8).astype(np.int32)
    toks = rng.integers(0, cfg.vocab_size, 16).astype(np.int32)
    cu, kv = np.asarray([0, 9, 14], np.int32), np.asarray([9, 5], np.int32)
    outs = []
    for impl in ("xla", "pallas_interpret"):
        out, _ = paged_forward_jit(cfg, params, toks, cu, kv, tables, init_paged_cache(cfg, 24, 4),
                                   q_per_req=9, impl=impl)  # fmt: skip
        outs.append(np.asarray(out.logits)[0, :14])
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5
