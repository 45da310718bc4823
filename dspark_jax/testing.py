"""Tiny deterministic targets, a tiny tokenizer and helpers shared by every test and benchmark."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import drafters
from dspark_jax.config import DrafterConfig, RopeScaling, TargetConfig
from dspark_jax.demo.corpus import sample_text
from dspark_jax.engine.compiles import CompileCounter as CompileCounter  # the retrace guard
from dspark_jax.models.hf import load_tokenizer
from dspark_jax.models.transformer import init_params
from dspark_jax.train import batches, tokenizer


def tiny_target_config(architecture: str = "qwen3", **overrides) -> TargetConfig:
    """A 4-layer, 64-wide target with GQA (4 q heads, 2 kv heads) and a 256-token vocab."""
    base = dict(
        architecture=architecture,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0 if architecture != "qwen3" else 1e6,
        tie_word_embeddings=architecture == "qwen3",
        max_position_embeddings=512,
        target_layer_ids=(0, 1, 2),
    )
    if architecture == "llama":
        base["rope_scaling"] = RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
    base.update(overrides)
    return TargetConfig(**base)


def small_target_config(**overrides) -> TargetConfig:
    """A ~30M-parameter Qwen3 config used by benchmarks (8 layers, 512 wide, 32k vocab)."""
    base = dict(
        architecture="qwen3",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        target_layer_ids=(1, 3, 5),
    )
    base.update(overrides)
    return TargetConfig(**base)


def random_tokens(seed: int, shape, vocab: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), jnp.int32)


def positions_like(tokens_BxT, start=0) -> jax.Array:
    b, t = tokens_BxT.shape
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    return start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def tiny_drafter_config(kind: str = "dspark", target=None, **overrides):
    """A drafter for `tiny_target_config()`: 2 layers (Eagle3: 1), γ=4, 8 anchors, r=16,
    mask token 255 (the last embedding row)."""
    target = target or tiny_target_config()
    base = dict(block_size=4)
    if kind != "eagle3":
        base.update(num_layers=2, num_anchors=8, mask_token_id=target.vocab_size - 1)
    if kind == "dspark":
        base.update(markov_rank=16)
    base.update(overrides)
    return getattr(DrafterConfig, kind)(target, **base)


def smoke_models(seed: int = 0):
    """(tcfg, tparams, dcfg, dparams) of the benchmarks' `--smoke` runs: `tiny_target_config()`
    (random weights, no compilation) and a 1-layer DSpark drafter, γ = 2, 4 anchors, r = 16. One
    pair for all of them, so the smoke runs in one process (tests/test_benchmarks_smoke.py) share
    the programs they compile."""
    tcfg = tiny_target_config()
    tparams = random_params(tcfg, seed)
    dcfg = smoke_drafter_config(tcfg)
    return tcfg, tparams, dcfg, drafters.init_params(dcfg, seed=seed + 1, target_params=tparams)


def smoke_drafter_config(target: TargetConfig | None = None) -> DrafterConfig:
    """The `smoke_models` drafter's configuration for `target` (default `tiny_target_config()`)."""
    target = target or tiny_target_config()
    return DrafterConfig.dspark(target, num_layers=1, block_size=2, num_anchors=4, markov_rank=16,
                                mask_token_id=target.vocab_size - 1)  # fmt: skip


def drafter_batch(
    target_cfg, target_params, batch: int = 2, length: int = 24, seed: int = 1, prompt: int = 5
):
    """A loss_fn batch from the target itself (`train.batches.drafter_batch`): random tokens,
    loss mask off for the first `prompt` tokens."""
    ids = random_tokens(seed, (batch, length), target_cfg.vocab_size - 1)
    mask = np.ones((batch, length), np.uint8)
    mask[:, :prompt] = 0
    return batches.drafter_batch(target_cfg, target_params, ids, mask)


def random_params(cfg: TargetConfig, seed: int):
    """Random target params without compiling an initializer (numpy fills an abstract state).

    Norm weights and biases are random too, so a dropped, misnamed or mis-sharded one changes
    the outputs (parity and sharding tests rely on that).
    """
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(jax.eval_shape(lambda: init_params(cfg))):
        shape = var.get_value().shape
        if any("norm" in str(k) for k in path):
            x = rng.uniform(0.5, 1.5, shape)
        else:
            x = rng.normal(0.0, 0.5 if path[-1] == "bias" else 0.05, shape)
        flat.append((path, var.replace(jnp.asarray(x, jnp.float32))))
    return nnx.from_flat_state(flat)


def tiny_tokenizer(cache_dir: str | os.PathLike, vocab_size: int = 512) -> Any:
    """A small tokenizer for tests, trained once on `corpus.sample_text()` and cached in
    ``cache_dir/tiny_tokenizer_v{version}_{vocab_size}`` (a second call only loads it)."""
    out = Path(cache_dir) / f"tiny_tokenizer_v{tokenizer.TOKENIZER_VERSION}_{vocab_size}"
    meta = tokenizer.read_meta(out)
    if (
        meta is not None
        and meta.get("fingerprint", {}).get("version") == tokenizer.TOKENIZER_VERSION
    ):
        return load_tokenizer(out, require_chat_template=True)
    return tokenizer.train_tokenizer([sample_text()], out, vocab_size, force=True)


# Gemma 4's chat format in small: `<|turn>{role}\n{content}<turn|>\n` per message, the assistant's
# role named "model", generation prompt `<|turn>model\n` (docs/METHOD.md §1.3).
GEMMA4_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)
GEMMA4_SPECIAL_TOKENS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>")


def gemma4_style_tokenizer(cache_dir: str | os.PathLike, vocab_size: int = 512) -> Any:
    """`tiny_tokenizer` with Gemma 4's turn and thought-channel markers as special tokens and a
    chat template of Gemma 4's shape (`GEMMA4_STYLE_TEMPLATE`): what a Gemma 4 checkpoint's
    tokenizer renders, built offline."""
    tok = tiny_tokenizer(cache_dir, vocab_size)
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA4_SPECIAL_TOKENS)})
    tok.chat_template = GEMMA4_STYLE_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------
# A target and a DSpark drafter that agree often (but not always), for engine exactness tests
# and the synthetic serving benchmark.
#
# The target is a random Qwen2 block whose residual branches are scaled by `mix`, with an untied
# LM head that maps each token's own (normalised) embedding to `perm[token]`: its next token is
# mostly `perm[current]`, but attention over the context changes it now and then (so cache
# mistakes change the output). The drafter's vanilla Markov head (rank V) adds
# `bias * onehot(perm[prev])`, so it drafts the permutation chain: drafts are accepted for
# several slots, then rejected where the context matters.


def _set(leaf, value):
    return leaf.replace(jnp.asarray(value, jnp.float32))


def agreeing_pair(
    vocab=64, gamma=4, mix=0.2, head_scale=8.0, markov_bias=500.0, seed=0, **target_kw
):
    """(tcfg, tparams, dcfg, dparams)."""
    tcfg = tiny_target_config("qwen2", vocab_size=vocab, **target_kw)
    tp = jax.tree.map(lambda x: x, random_params(tcfg, seed))
    for i in range(tcfg.num_layers):
        layer = tp["layers"][i]
        o = layer["self_attn"]["o_proj"]["kernel"]
        layer["self_attn"]["o_proj"]["kernel"] = _set(o, o[...] * mix)
        d = layer["mlp"]["down_proj"]["kernel"]
        layer["mlp"]["down_proj"]["kernel"] = _set(d, d[...] * mix)
    perm = np.random.default_rng(seed).permutation(vocab)
    emb = np.asarray(tp["embed_tokens"][...])
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((tcfg.hidden_size, vocab), np.float32)
    head[:, perm] = (unit * head_scale).T
    tp["lm_head"]["kernel"] = _set(tp["lm_head"]["kernel"], head)
    dcfg, dp = markov_drafter(tcfg, tp, perm, gamma, markov_bias, seed)
    return tcfg, tp, dcfg, dp


def markov_drafter(tcfg, tp, perm, gamma, markov_bias, seed):
    """(dcfg, dparams): a one-layer DSpark drafter for `tcfg` whose vanilla Markov head (rank V)
    adds `markov_bias * onehot(perm[prev])`: it drafts the permutation chain."""
    vocab = tcfg.vocab_size
    dcfg = DrafterConfig.dspark(
        tcfg,
        num_layers=1,
        block_size=gamma,
        mask_token_id=vocab - 1,
        num_anchors=8,
        markov_rank=vocab,
        markov_head_type="vanilla",
    )
    dp = drafters.init_params(dcfg, seed=seed + 1, target_params=tp)
    tr = jax.tree.map(lambda x: x, dp.trainable)
    w2 = np.zeros((vocab, vocab), np.float32)
    w2[np.arange(vocab), perm] = markov_bias
    mh = tr["markov_head"]
    mh["markov_w1"] = _set(mh["markov_w1"], np.eye(vocab, dtype=np.float32))
    mh["markov_w2"]["kernel"] = _set(mh["markov_w2"]["kernel"], w2)
    return dcfg, dp._replace(trainable=tr)
