"""Decoding's hot paths on the demo's models against the formulations they replaced, in one run.

The demo's target (configs/tiny.py: 16 layers x 160, vocab 2048, random init) and its drafters
(2-layer DSpark, Eagle3; γ = 7), each program compiled twice:

* ``current``: the library as it is;
* ``baseline``: attention over a cache through `jnp.einsum` with the queries as the left operand
  (XLA:CPU then copies the key cache to [d, S] on every call), the batch-1 verify forward's own
  tokens as a second key set, and drafters that compute each slot's distribution inside their
  sequential loop and draw from it with `jax.random.categorical` (one softmax and one threefry
  pass per slot) — how they were written before `layers._few_queries_*`, `models.packed`'s
  `one_set`, `spec.sampling.gumbel_noise` and `drafters.common.draw_tokens` drawing from logits.

Timed interleaved after compiling, medians of ``--reps``:
  decode_b32      32 greedy decode steps at batch 32, cache 256 (regeneration, evaluation);
  decode_b1       the same at batch 1 (plain decoding of one request);
  verify_b1       the 8-token packed verify forward at batch 1 (a speculative round's verify):
                  the baseline attends to the cached prefix and to the tokens' own K/V as two
                  key sets (one merged softmax) with separate q / k / v and gate / up products,
                  the current reads the tokens' K/V back from the cache in one set and fuses
                  those products (`models.packed`'s `one_set` and `fused`, a single-program
                  engine's form), the kernels concatenated on every call as in a one-round
                  call (verify_profile.py times it in a loop, as the K-round program runs it);
  verify_b8       the packed verify forward at batch 8 (8 slots x 8 tokens, cache 256): the
                  baseline gathers every token's slot cache (`T` copies of the keys and values
                  per layer), the current lays the queries out slot-major and reads each slot's
                  cache in place (`models.packed`'s `slot_tokens`);
  propose_dspark  DSpark's γ = 7 proposal at batch 1, sampled;
  propose_eagle3  Eagle3's γ = 7 proposal at batch 1, sampled.

Prints ONE JSON object: ``<name>_ms`` and ``baseline_<name>_ms`` per program, ``speedup``
(baseline / current per name), ``draft_tokens_equal`` / ``decode_tokens_equal`` (the same tokens
on both paths), ``draft_probs_max_diff`` / ``verify_logits_max_diff`` / ``verify_b8_logits_max_diff`` (float reassociation in the
attention only: the draws themselves are bit-identical, tests/test_spec_sampling.py), ``reps``,
``platform``.

    python benchmarks/decode_paths.py [--reps 9]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax import drafters  # noqa: E402
from dspark_jax.drafters import common  # noqa: E402
from dspark_jax.drafters import dspark as dspark_mod  # noqa: E402
from dspark_jax.drafters import eagle3 as eagle3_mod  # noqa: E402
from dspark_jax.models import generate as gen  # noqa: E402
from dspark_jax.models import layers  # noqa: E402
from dspark_jax.models import transformer as tf  # noqa: E402
from dspark_jax.models.packed import packed_forward  # noqa: E402
from dspark_jax.spec import sampling as spec_sampling  # noqa: E402

GAMMA, CACHE, STEPS = 7, 256, 32


def _scores_einsum(q, k):
    """Attention scores as they were computed before: q the left operand of one einsum."""
    return jnp.einsum("buqkrd,bksd->buqkrs", q, k, preferred_element_type=jnp.float32)


def _values_einsum(p, v):
    return jnp.einsum("buqkrs,bksd->buqkrd", p, v)


def _noise_as_keys(keys_BxG, num_classes, scfg):
    """Baseline drafting: no noise made ahead; each slot's key goes into the loop."""
    return None if scfg is not None and scfg.greedy else keys_BxG


def _draw_in_loop(keys_B, logits_BxV, sampling, scfg):
    """Baseline drawing: the slot's distribution inside the loop, one threefry pass per slot."""
    probs = common.sampling_probs(logits_BxV, sampling, scfg)
    if scfg is not None and scfg.greedy:
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)
    return spec_sampling.sample_from_probs(keys_B, probs)


class _Baseline:
    """Swap the replaced formulations in while programs are traced."""

    on = False  # read by the batched verify's builder (an argument, not a swapped function)

    def __enter__(self):
        _Baseline.on = True
        self.saved = (layers._few_queries_scores, layers._few_queries_values,
                      dspark_mod.draft_noise, dspark_mod.draw_tokens,
                      eagle3_mod.draft_noise, eagle3_mod.draw_tokens)  # fmt: skip
        layers._few_queries_scores, layers._few_queries_values = _scores_einsum, _values_einsum
        dspark_mod.draft_noise = eagle3_mod.draft_noise = _noise_as_keys
        dspark_mod.draw_tokens = eagle3_mod.draw_tokens = _draw_in_loop

    def __exit__(self, *exc):
        _Baseline.on = False
        (layers._few_queries_scores, layers._few_queries_values,
         dspark_mod.draft_noise, dspark_mod.draw_tokens,
         eagle3_mod.draft_noise, eagle3_mod.draw_tokens) = self.saved  # fmt: skip


def _programs(tcfg, tparams, ds, options=None):
    """name -> (compiled program, its arguments); traced under the current swap state;
    `options`: compiler options (None: XLA's default, what decoding compiles with)."""
    rng = np.random.default_rng(0)
    out = {}

    def decode(params, cache, tok):
        def body(_, c):
            cache, tok = c
            o, cache = gen.extend(tcfg, params, tok, cache)
            nxt = jnp.argmax(o.logits[:, -1], -1)[:, None].astype(jnp.int32)
            return cache.with_lengths(cache.lengths + 1), nxt

        return jax.lax.fori_loop(0, STEPS, body, (cache, tok))[1]

    cache = tf.init_cache(tcfg, 32, CACHE).with_lengths(jnp.full((32,), 100, jnp.int32))
    tok = jnp.asarray(rng.integers(5, tcfg.vocab_size, (32, 1)), jnp.int32)
    out["decode_b32"] = (
        jax.jit(decode).lower(tparams, cache, tok).compile(options),
        (tparams, cache, tok),
    )
    cache1 = tf.init_cache(tcfg, 1, CACHE).with_lengths(jnp.full((1,), 100, jnp.int32))
    out["decode_b1"] = (
        jax.jit(decode).lower(tparams, cache1, tok[:1]).compile(options),
        (tparams, cache1, tok[:1]),
    )

    def verify(params, cache, toks):
        off = jnp.arange(GAMMA + 1, dtype=jnp.int32)
        zeros = jnp.zeros((GAMMA + 1,), jnp.int32)
        o, _ = packed_forward(tcfg, params, toks, zeros, off, cache.lengths[0] + off, off >= 0,
                              cache, CACHE, one_set=not _Baseline.on,
                              fused=not _Baseline.on)  # fmt: skip
        return o.logits

    c1 = tf.init_cache(tcfg, 1, CACHE).with_lengths(jnp.array([100], jnp.int32))
    toks = jnp.asarray(rng.integers(5, tcfg.vocab_size, (GAMMA + 1,)), jnp.int32)
    out["verify_b1"] = (
        jax.jit(verify).lower(tparams, c1, toks).compile(options),
        (tparams, c1, toks),
    )

    n8, t8 = 8, 8 * (GAMMA + 1)
    slot8 = jnp.repeat(jnp.arange(n8, dtype=jnp.int32), GAMMA + 1)
    off8 = jnp.tile(jnp.arange(GAMMA + 1, dtype=jnp.int32), n8)
    by_slot = 0 if _Baseline.on else GAMMA + 1  # slot_tokens 0: the per-token gather

    def verify8(params, cache, toks):
        pos = cache.lengths[slot8] + off8
        o, _ = packed_forward(tcfg, params, toks, slot8, off8, pos, off8 >= 0, cache, CACHE,
                              slot_tokens=by_slot)  # fmt: skip
        return o.logits

    c8 = tf.init_cache(tcfg, n8, CACHE).with_lengths(
        jnp.asarray(rng.integers(60, 200, n8), jnp.int32)
    )
    fill = lambda kv: tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in kv)
    c8 = c8._replace(k=fill(c8.k), v=fill(c8.v))  # cached keys that matter to the logits
    toks8 = jnp.asarray(rng.integers(5, tcfg.vocab_size, (t8,)), jnp.int32)
    out["verify_b8"] = (
        jax.jit(verify8).lower(tparams, c8, toks8).compile(options),
        (tparams, c8, toks8),
    )

    feats = tf.forward(tcfg, tparams, tok[:1, :1].repeat(40, 1), jnp.arange(40)[None], None)[0]
    for kind, (dcfg, dparams) in ds.items():
        nxt = jnp.asarray(rng.integers(5, tcfg.vocab_size, (1, 40)), jnp.int32)
        ctx = drafters.init_context(dcfg, 1, CACHE)
        ctx = drafters.extend_context(dcfg, dparams, ctx, feats.features, nxt,
                                      jnp.array([40], jnp.int32))  # fmt: skip

        def propose(dparams, ctx, anchor, key, seeds, dcfg=dcfg):
            p = drafters.propose(dcfg, dparams, ctx, anchor, key, seeds, None, None,
                                 rounds_B=jnp.zeros_like(seeds))  # fmt: skip
            return p.tokens, p.probs

        args = (dparams, ctx, nxt[:, -1], jax.random.key(3), jnp.zeros((1,), jnp.uint32))
        out[f"propose_{kind}"] = (jax.jit(propose).lower(*args).compile(options), args)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    import drafter_step  # the demo's models, shared with the training benchmarks

    _, tcfg, tparams, dcfgs = drafter_step.demo_models()
    assert dcfgs["dspark"].block_size == GAMMA
    ds = {k: (dcfgs[k], drafters.init_params(dcfgs[k], target_params=tparams))
          for k in ("dspark", "eagle3")}  # fmt: skip

    progs = {"current": _programs(tcfg, tparams, ds)}
    with _Baseline():
        progs["baseline"] = _programs(tcfg, tparams, ds)

    outs = {v: {k: jax.block_until_ready(p(*a)) for k, (p, a) in progs[v].items()} for v in progs}
    names = list(progs["current"])
    times = {(v, k): [] for v in progs for k in names}
    order = [(v, k) for k in names for v in progs]
    for _ in range(args.reps):
        for v, k in order:
            p, a = progs[v][k]
            reps = 1 if k.startswith("decode") else 20
            t = time.perf_counter()
            for _ in range(reps):
                r = p(*a)
            jax.block_until_ready(r)
            times[(v, k)].append((time.perf_counter() - t) / reps)
    med = {vk: float(np.median(t)) * 1000 for vk, t in times.items()}
    res = {}
    for k in names:
        res[f"{k}_ms"] = round(med[("current", k)], 3)
        res[f"baseline_{k}_ms"] = round(med[("baseline", k)], 3)
    res["speedup"] = {k: round(med[("baseline", k)] / med[("current", k)], 3) for k in names}
    drafts = [k for k in names if k.startswith("propose_")]
    res["draft_tokens_equal"] = all(
        bool(np.array_equal(outs["current"][k][0], outs["baseline"][k][0])) for k in drafts
    )
    res["draft_probs_max_diff"] = max(
        float(jnp.max(jnp.abs(outs["current"][k][1] - outs["baseline"][k][1]))) for k in drafts
    )
    res["decode_tokens_equal"] = bool(
        np.array_equal(outs["current"]["decode_b32"], outs["baseline"]["decode_b32"])
    )
    res["verify_logits_max_diff"] = float(
        jnp.max(jnp.abs(outs["current"]["verify_b1"] - outs["baseline"]["verify_b1"]))
    )
    res["verify_b8_logits_max_diff"] = float(
        jnp.max(jnp.abs(outs["current"]["verify_b8"] - outs["baseline"]["verify_b8"]))
    )
    res["reps"] = args.reps
    res["platform"] = f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"
    print(json.dumps(res))


if __name__ == "__main__":
    main()
