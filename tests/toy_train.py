"""A toy drafter and loss with the trainer's loss contract (used by the trainer tests and the
subprocess helper). Small enough that a training step costs milliseconds on CPU.

The toy drafter reads the target features at position t and predicts the tokens at t+1..t+γ
through γ small heads and a frozen copy of the target's LM head; its loss is CE + L1 against the
target's own next-token distributions (recomputed from `target_hidden`), on a random 80% subset of
supervised positions drawn from the step's RNG (so the RNG matters, like anchor sampling).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import transformer
from dspark_jax.testing import tiny_target_config
from dspark_jax.train.data import TokenizedSample

GAMMA = 3
HIDDEN = 32


class FrozenParam(nnx.Variable):
    """Not an nnx.Param: kept out of the trainable state."""


class ToyDrafter(nnx.Module):
    def __init__(self, feature_size: int, hidden: int, vocab: int, target_h: int, *, rngs):
        k = rngs.params
        self.fc = nnx.Param(
            0.05 * jax.random.normal(k(), (feature_size, hidden)), logical=(None, "embed")
        )
        self.heads = nnx.Param(
            0.05 * jax.random.normal(k(), (GAMMA, hidden, target_h)),
            logical=(None, "embed", "mlp"),
        )
        self.lm_head = FrozenParam(jnp.zeros((target_h, vocab)), logical=("embed", "vocab"))


def toy_params(target_cfg, target_params, seed: int = 0):
    """(trainable, frozen) nnx.States; the frozen LM head is the target's tied embedding^T."""
    m = ToyDrafter(
        target_cfg.feature_size,
        HIDDEN,
        target_cfg.vocab_size,
        target_cfg.hidden_size,
        rngs=nnx.Rngs(seed),
    )
    _, trainable, frozen = nnx.split(m, nnx.Param, FrozenParam)
    frozen["lm_head"] = frozen["lm_head"].replace(jnp.asarray(target_params["embed_tokens"][...]).T)
    return trainable, frozen


def toy_loss(trainable, frozen, batch, rng, *, keep_prob: float = 0.8):
    """CE + L1 over γ future tokens; metrics follow the losses.py contract."""
    ids = batch["input_ids"]  # [B, L]
    mask = batch["loss_mask"].astype(jnp.float32)
    feats = batch["target_features"]
    head = frozen["lm_head"][...]
    z = jnp.tanh(feats @ trainable["fc"][...].astype(feats.dtype))  # [B, L, h]
    tlogits = jnp.einsum(
        "blh,hv->blv", batch["target_hidden"], head, preferred_element_type=jnp.float32
    )
    keep = jax.random.bernoulli(rng, keep_prob, ids.shape).astype(jnp.float32)
    length = ids.shape[1]
    ce_num = l1_num = den = 0.0
    acc_num, acc_den = [], []
    for k in range(GAMMA):
        h = z @ trainable["heads"][k].astype(z.dtype)
        logits = jnp.einsum("blh,hv->blv", h, head, preferred_element_type=jnp.float32)
        logp = jax.nn.log_softmax(logits[:, : length - 1 - k])  # predicts t+1+k from t
        tgt = ids[:, 1 + k :]
        w = mask[:, 1 + k :] * keep[:, : length - 1 - k]
        ce = -jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0]
        pt = jax.nn.softmax(tlogits[:, k : length - 1])  # target's dist for token t+1+k
        l1 = jnp.abs(jnp.exp(logp) - pt).sum(-1)
        wk = float(np.exp(-k / 4.0))
        ce_num += wk * (w * ce).sum()
        l1_num += wk * (w * l1).sum()
        den += wk * w.sum()
        acc_num.append((w * (1.0 - 0.5 * jax.lax.stop_gradient(l1))).sum())
        acc_den.append(w.sum())
    ce = ce_num / (den + 1e-6)
    l1 = l1_num / (den + 1e-6)
    loss = 0.5 * ce + 0.5 * l1
    metrics = {
        "ce": ce,
        "l1": l1,
        "ce_num": ce_num,
        "ce_den": den,
        "accept_num": jnp.stack(acc_num),
        "accept_den": jnp.stack(acc_den),
    }
    return loss, metrics


def make_samples(n: int, vocab: int, lengths=(12, 30), seed: int = 0, empty_every: int = 0):
    """Learnable token sequences (x_{t+1} = 5 x_t + 17 mod V from a random start) with a
    supervised tail (the 'assistant' part)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = np.empty(length, np.int64)
        ids[0] = rng.integers(0, vocab)
        for t in range(1, length):
            ids[t] = (5 * ids[t - 1] + 17) % vocab
        ids = ids.astype(np.int32)
        mask = np.zeros(length, np.uint8)
        if not (empty_every and i % empty_every == empty_every - 1):
            mask[length // 3 :] = 1
        out.append(TokenizedSample(ids, mask, id=i))
    return out


@functools.lru_cache(maxsize=4)
def tiny_target(seed: int = 0):
    cfg = tiny_target_config()
    return cfg, transformer.init_params(cfg, seed)


def base_config(**overrides):
    """Small, fp32, single-bucket training config used across the trainer tests."""
    from dspark_jax.config import TrainConfig

    base = dict(
        global_batch_size=4,
        micro_batch_size=2,
        seq_buckets=(32,),
        total_steps=6,
        warmup_ratio=0.34,
        learning_rate=1e-2,
        eval_interval=0,
        checkpoint_interval=0,
        compute_dtype="float32",
        progress_bar=False,
        log_interval=1,
        async_checkpoint=True,
    )
    base.update(overrides)
    return TrainConfig(**base)


def one_device_mesh():
    from dspark_jax import parallel
    from dspark_jax.config import MeshConfig

    return parallel.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])


def toy_trainer(run_dir, cfg=None, *, n_train=20, n_eval=0, mesh=None, resume=True, **kw):
    """A Trainer over the toy drafter and the tiny target (online features)."""
    from dspark_jax.train.trainer import Trainer

    tcfg, tparams = tiny_target()
    trainable, frozen = toy_params(tcfg, tparams)
    if "train_data" not in kw:
        kw["train_data"] = make_samples(n_train, tcfg.vocab_size)
    if "eval_data" not in kw:
        kw["eval_data"] = make_samples(n_eval, tcfg.vocab_size, seed=1) if n_eval else None
    return Trainer(
        cfg or base_config(),
        toy_loss,
        trainable,
        frozen,
        run_dir=run_dir,
        target_cfg=tcfg,
        target_params=tparams,
        mesh=mesh or one_device_mesh(),
        resume=resume,
        **kw,
    )
