"""Decode τ against the training metric on the same texts: where a decode's rounds start.

The drafters stage selects checkpoints by the reference's training τ: teacher forced, one block
at every anchor of a held-out text, τ_block = 1 + Σ_k Π_{i≤k} (1 − TV_i). The evaluation's τ is
measured by decoding: tokens / rounds. On the demo the two rank the drafters differently (DSpark
+8% over Eagle3 on the held-out training τ, level in the decode table), and this script shows
why, on the demo's own models, prompts and seeds (the evaluate stage's first pass, so the decode
τ below is the report's):

1. Decode every evaluation prompt with each drafter (fixed block, `evaluate.temperature`).
2. Teacher-force each drafter on the decoded texts (prompt + answer): per anchor a in the answer
   the per-slot acceptance 1 − TV(p_target, q_drafter) of the block a+1 … a+γ.
3. Report, per drafter and dataset:
   * ``decode_tau`` — tokens / rounds of step 1;
   * ``tf_tau_uniform`` — the training metric: mean τ_block over every anchor of the texts;
   * ``tf_tau_at_rounds`` — mean τ_block over the anchors the decode's rounds actually started
     at, split by what preceded the round (``first`` round after the prompt; ``after_full``: the
     previous round accepted every draft, its bonus token is the anchor; ``after_reject``: the
     anchor is the token resampled at a rejection), with the count of rounds of each kind;
   * ``martingale`` — exactness check of the decode: per round the accepted drafts n_r against
     Σ_{k ≤ min(n_r + 1, γ)} (1 − TV_k) teacher forced at the round's anchor (each slot's
     acceptance probability given that the slots before it were accepted, which is what the
     decode's drafter saw); their means agree within a few standard errors (``z``) when the
     serving engine drafts exactly what the training path computes.

Rounds cluster where the text is hard to draft (a rejection is followed by another round in the
same place), so the decode weights hard anchors more than the uniform training metric does.

    python benchmarks/decode_anchors.py --run-dir runs/tiny [--prompts 24]

Prints one JSON object: {drafter: {dataset: {...}}, "summary": {gain over each other drafter
under decode τ and under the uniform training metric, macro over datasets}}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspark_jax.drafters.api import build  # noqa: E402
from dspark_jax.drafters.common import lm_logits  # noqa: E402
from dspark_jax.drafters.dspark import teacher_forced  # noqa: E402
from dspark_jax.drafters.eagle3 import ttt_hidden  # noqa: E402
from dspark_jax.train.anchors import make_blocks  # noqa: E402
from dspark_jax.train.features import target_features  # noqa: E402

KINDS_OF_ROUND = ("first", "after_full", "after_reject")


def _tv_accept(p_t, logits):
    """1 − TV(p_t, softmax(logits)) over the last axis."""
    q = jax.nn.softmax(logits.astype(jnp.float32), -1)
    return 1.0 - 0.5 * jnp.abs(p_t - q).sum(-1)


def _acceptance(tcfg, tparams, dcfg, dparams, ids, mask, anchors):
    """[B, N, γ] teacher-forced acceptance of the block after each anchor (anchors [B, N])."""
    model = build(dcfg, dparams)
    b, seq = ids.shape
    feats, hidden = target_features(tcfg, tparams, ids)
    lm = dparams.frozen["lm_head"][...]
    p_all = jax.nn.softmax(lm_logits(lm, hidden.astype(lm.dtype)).astype(jnp.float32), -1)
    g = dcfg.block_size
    if dcfg.kind == "eagle3":
        # row t = a − 1: the committed feature before the anchor x_a (tests/test_drafters.py,
        # test_eagle3_ttt_matches_inference); step k predicts x_{a+k+1}
        steps = ttt_hidden(model, feats, ids, jnp.full((b,), seq, jnp.int32))  # [γ, B, L, H]
        rows = anchors - 1
        acc = []
        for k in range(g):
            h = jax.vmap(lambda s, r: s[r])(steps[k], rows)  # [B, N, H]
            p = jax.vmap(lambda s, r: s[r])(p_all, jnp.minimum(anchors + k, seq - 1))
            acc.append(_tv_accept(p, model.logits(h)))
        return jnp.stack(acc, -1)
    keep = jnp.ones(anchors.shape, bool)
    blk = make_blocks(ids, mask, anchors, keep, g, dcfg.mask_token_id)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    z = model.blocks(model.context_kv(feats, pos), blk.anchors, blk.keep, blk.block_ids,
                     blk.positions)  # fmt: skip
    out = teacher_forced(model, z, blk.prev_ids)
    p = jax.vmap(lambda s, r: s[r])(p_all, blk.target_pos)
    return _tv_accept(p, out.logits)


_acceptance_jit = jax.jit(_acceptance, static_argnums=(0, 2))


def _pad(rows, fill=0):
    n = max(len(r) for r in rows)
    out = np.full((len(rows), n), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def analyse(run, kind, prompts, results, gamma, decode_tau):
    """The per-dataset numbers (see the module docstring) for one drafter's decode."""
    tcfg, tparams = run.target()
    dcfg, dparams = run.drafter(kind)
    texts = [list(p) + list(r.tokens) for p, r in zip(prompts, results)]
    seq = 1 << int(np.ceil(np.log2(max(len(t) for t in texts) + 1)))
    ids = np.zeros((len(texts), seq), np.int32)
    mask = np.zeros((len(texts), seq), np.float32)
    uniform, rounds = [], []  # anchors per text; (text, anchor, accepted, kind of round)
    for i, (p, t) in enumerate(zip(prompts, texts)):
        ids[i, : len(t)] = t
        mask[i, len(p) : len(t)] = 1
        uniform.append(list(range(len(p), len(t) - gamma)))  # whole blocks inside the answer
    for i, (p, r) in enumerate(zip(prompts, results)):
        a = len(p)
        for j, n in enumerate(r.num_accepted):
            if a + gamma < len(texts[i]) and not r.eos[j]:
                prev = (
                    "first"
                    if j == 0
                    else ("after_full" if r.num_accepted[j - 1] == gamma else "after_reject")
                )
                rounds.append((i, a, n, prev))
            a += n + 1
    anchors = _pad([u or [len(prompts[i])] for i, u in enumerate(uniform)])
    acc = np.asarray(_acceptance_jit(tcfg, tparams, dcfg, dparams, jnp.asarray(ids),
                                     jnp.asarray(mask), jnp.asarray(anchors)))  # fmt: skip
    tau_block = 1.0 + np.cumprod(acc, -1).sum(-1)  # [B, N]
    tf_uniform = np.concatenate([tau_block[i, : len(u)] for i, u in enumerate(uniform)])
    where = {(i, a): j for i, u in enumerate(uniform) for j, a in enumerate(u)}
    by_kind = {k: [] for k in KINDS_OF_ROUND}
    accepted, expected = [], []
    k = np.arange(gamma)
    for i, a, n, prev in rounds:
        j = where[(i, a)]
        by_kind[prev].append(tau_block[i, j])
        accepted.append(n)
        expected.append(float((acc[i, j] * (k < min(n + 1, gamma))).sum()))
    accepted, expected = np.asarray(accepted, float), np.asarray(expected)
    se = float((accepted - expected).std(ddof=1) / np.sqrt(len(accepted)))
    return {
        "decode_tau": decode_tau,
        "tf_tau_uniform": float(tf_uniform.mean()),
        "tf_tau_at_rounds": float(np.mean([x for v in by_kind.values() for x in v])),
        "tf_tau_by_round": {k: float(np.mean(v)) if v else None for k, v in by_kind.items()},
        "rounds_by_kind": {k: len(v) for k, v in by_kind.items()},
        "martingale": {
            "rounds": len(accepted),
            "accepted_mean": float(accepted.mean()),
            "expected_mean": float(expected.mean()),
            "z": float((accepted.mean() - expected.mean()) / se) if se > 0 else 0.0,
        },
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="runs/tiny")
    ap.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="prompts per dataset (0: evaluate.max_prompts_per_dataset)",
    )
    args = ap.parse_args()
    import dataclasses

    from dspark_jax.eval import offline
    from dspark_jax.run.evaluate_stage import eval_modes
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.run.rundir import RunDir
    from dspark_jax.train.data import select_prompts

    # the run's own configuration: the same prompts, seeds and decoders as its evaluate stage
    cfg = dataclasses.replace(RunDir(args.run_dir).config, run_dir=args.run_dir)
    p = Pipeline(cfg)
    e = cfg.evaluate
    cap = args.prompts or e.max_prompts_per_dataset
    datasets = {}
    for name, (dom, turns) in p.eval_sets().items():
        kept, _, _ = p.fitting_prompts(turns, e.max_new_tokens)
        sel = tuple(select_prompts(kept, e.max_prompts_per_dataset))[:cap]
        if sel:
            datasets[name] = offline.EvalDataset(name, dom, sel)
    longest = max(len(q) for ds in datasets.values() for q in ds.prompts)
    out = {}
    for kind in cfg.drafters.kinds:
        dec = p.rundir.decoder_for(kind, [longest], e.max_new_tokens, e.max_len, lean=True,
                                   modes=eval_modes(e))  # fmt: skip
        out[kind] = {}
        for name, ds in datasets.items():
            res = offline.run_dataset(
                dec, ds, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                seed=e.seed, stop_ids=p.stop_ids(), batch_size=e.batch_size,
            )  # fmt: skip
            g = dec.dcfg.block_size
            tau = offline.summarize(res, g)["tau"]
            out[kind][name] = analyse(p.rundir, kind, ds.prompts, res, g, tau)
            print(f"{kind} {name}: " + json.dumps(out[kind][name]), file=sys.stderr)
    macro = {k: {m: float(np.mean([v[m] for v in out[k].values()]))
                 for m in ("decode_tau", "tf_tau_uniform", "tf_tau_at_rounds")} for k in out}  # fmt: skip
    gains = {}
    for a in out:
        for b in out:
            if a != b:
                gains[f"{a}_vs_{b}"] = {
                    m: round(macro[a][m] / macro[b][m] - 1.0, 4) for m in macro[a]
                }
    out["summary"] = {"macro": macro, "gains": gains, "prompts_per_dataset": cap,
                      "temperature": e.temperature,
                      "platform": f"{platform.machine()} {jax.default_backend()} x{os.cpu_count()}"}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
