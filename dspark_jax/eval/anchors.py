"""Decoded rounds against the training path: where rounds start, and is the decode exact.

The drafters stage scores a drafter by teacher forcing: one block at every anchor of a text,
per slot the acceptance 1 − TV(p_target, q_drafter), τ_block = 1 + Σ_k Π_{i≤k} (1 − TV_i). A
decode measures tokens / rounds. Given the decode's own texts (prompt + answer) and per-round
records (`RequestOutput`: `num_accepted`, `eos`), this module computes, per drafter:

* `teacher_forced_acceptance`: [B, N, γ] acceptances of the blocks after given anchors, from the
  drafter's training-path computation (DSpark / DFlash: anchor-bounded blocks with
  teacher-forced previous tokens; Eagle3: the training-time-test steps of the row before the
  anchor);
* `round_anchors`: where each round started (position of its anchor) and what preceded it (the
  `first` round after the prompt, `after_full` acceptance — the anchor is the bonus token —, or
  `after_reject` — the anchor is the token resampled at the rejection);
* `anchor_report`: τ_block averaged over every anchor of the answers (the training metric on
  these texts) and over the anchors the rounds started at (per kind of round), and the
  martingale check: per round the accepted drafts n_r against Σ_{k ≤ min(n_r + 1, γ)} (1 − TV_k)
  at the round's anchor — slot k's acceptance probability given that the slots before it were
  accepted, which is what the decode's drafter saw. Their means agree within a few standard
  errors (`z`) when the serving engine drafts exactly what the training path computes; a drafter
  whose inference context differs from its training context fails it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.drafters.api import build
from dspark_jax.drafters.common import lm_logits
from dspark_jax.drafters.dspark import teacher_forced
from dspark_jax.drafters.eagle3 import ttt_hidden
from dspark_jax.spec.metrics import block_tau
from dspark_jax.train.anchors import make_blocks
from dspark_jax.train.features import target_features
from dspark_jax.train.losses import ce_and_l1

ROUND_KINDS = ("first", "after_full", "after_reject")


def _accept(p_t, logits):
    """1 − TV(p_t, softmax(logits)) over the last axis, as the losses compute it (c*)."""
    _, l1 = ce_and_l1(logits.astype(jnp.float32), p_t)
    return jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0)


@functools.partial(jax.jit, static_argnums=(0, 2))
def teacher_forced_acceptance(tcfg, tparams, dcfg, dparams, ids_BxL, anchors_BxN):
    """[B, N, γ] acceptance of the block after each anchor under teacher forcing (T = 1).

    Anchor a: the block drafts x_{a+1} … x_{a+γ} from the target features of positions < a and
    the token x_a; the caller keeps a + γ inside the text."""
    model = build(dcfg, dparams)
    b, seq = ids_BxL.shape
    feats, hidden = target_features(tcfg, tparams, ids_BxL)
    lm = dparams.frozen["lm_head"][...]
    t_logits = lm_logits(lm, hidden.astype(lm.dtype), dcfg.logit_softcap)
    p_all = jax.nn.softmax(t_logits.astype(jnp.float32), -1)
    g = dcfg.block_size
    take = jax.vmap(lambda s, r: s[r])
    if dcfg.kind == "eagle3":
        # row t = a − 1 holds the committed feature before the anchor and the anchor's token
        # (tests/test_drafters.py, test_eagle3_ttt_matches_inference); step k drafts x_{a+k+1}
        steps = ttt_hidden(model, feats, ids_BxL, jnp.full((b,), seq, jnp.int32))
        rows = jnp.maximum(anchors_BxN - 1, 0)
        acc = [
            _accept(
                take(p_all, jnp.minimum(anchors_BxN + k, seq - 1)),
                model.logits(take(steps[k], rows)),
            )  # fmt: skip
            for k in range(g)
        ]
        return jnp.stack(acc, -1)
    keep = jnp.ones(anchors_BxN.shape, bool)
    mask = jnp.ones_like(ids_BxL)
    blk = make_blocks(ids_BxL, mask, anchors_BxN, keep, g, dcfg.mask_token_id)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    kv = model.context_kv(feats, pos)
    z = model.blocks(kv, blk.anchors, blk.keep, blk.block_ids, blk.positions)
    out = teacher_forced(model, z, blk.prev_ids)
    return _accept(take(p_all, blk.target_pos), out.logits)


def round_anchors(prompt_lens, results, gamma):
    """[(request, anchor position, accepted drafts, kind of round)] of every round whose whole
    block lies inside the decoded text and that did not end on a stop draft."""
    out = []
    for i, (plen, r) in enumerate(zip(prompt_lens, results)):
        end, a = plen + len(r.tokens), plen
        for j, n in enumerate(r.num_accepted):
            if a + gamma < end and not r.eos[j]:
                if j == 0:
                    kind = "first"
                else:
                    kind = "after_full" if r.num_accepted[j - 1] == gamma else "after_reject"
                out.append((i, a, int(n), kind))
            a += n + 1
    return out


def anchor_report(tcfg, tparams, dcfg, dparams, prompts, results) -> dict:
    """The module docstring's numbers for one drafter's decode of `prompts` (`results`)."""
    g = dcfg.block_size
    texts = [list(p) + list(r.tokens) for p, r in zip(prompts, results)]
    seq = 1 << int(np.ceil(np.log2(max(len(t) for t in texts) + 1)))
    uniform = [list(range(len(p), len(t) - g)) or [len(p)] for p, t in zip(prompts, texts)]
    ids = np.zeros((len(texts), seq), np.int32)
    anchors = np.zeros((len(texts), max(len(u) for u in uniform)), np.int32)
    for i, (t, u) in enumerate(zip(texts, uniform)):
        ids[i, : len(t)], anchors[i, : len(u)] = t, u
    acc = np.asarray(teacher_forced_acceptance(
        tcfg, tparams, dcfg, dparams, jnp.asarray(ids), jnp.asarray(anchors)))  # fmt: skip
    tau = block_tau(acc)  # [B, N]
    whole = [len(t) - g > len(p) for p, t in zip(prompts, texts)]
    every = [tau[i, : len(u)] for i, u in enumerate(uniform) if whole[i]]
    where = {(i, a): j for i, u in enumerate(uniform) for j, a in enumerate(u)}
    rounds = round_anchors([len(p) for p in prompts], results, g)
    by_kind = {k: [] for k in ROUND_KINDS}
    accepted, expected = [], []
    for i, a, n, kind in rounds:
        j = where[(i, a)]
        by_kind[kind].append(float(tau[i, j]))
        accepted.append(n)
        expected.append(float(acc[i, j, : min(n + 1, g)].sum()))
    d = np.asarray(accepted, float) - np.asarray(expected)
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    return {
        "tf_tau_uniform": float(np.concatenate(every).mean()) if every else float("nan"),
        "tf_tau_at_rounds": float(np.mean([x for v in by_kind.values() for x in v])),
        "tf_tau_by_round": {k: float(np.mean(v)) if v else None for k, v in by_kind.items()},
        "rounds_by_kind": {k: len(v) for k, v in by_kind.items()},
        "martingale": {
            "rounds": len(d),
            "accepted_mean": float(np.mean(accepted)),
            "expected_mean": float(np.mean(expected)),
            "z": float(d.mean() / se) if se > 0 else 0.0,
        },
    }
