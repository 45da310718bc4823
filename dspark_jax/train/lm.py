"""Training the target LM itself (the embedded demo's target): next-token cross-entropy.

Uses the drafter trainer's optimizer (`optimizer.make_optimizer`: AdamW, warmup + cosine, global-norm
clipping) and its orbax `Checkpointer`, so an interrupted run resumes from its last checkpoint
with the same data order. Batches are fixed-shape [batch_size, seq_len] windows cut from the
tokenized conversations (packed end to end, so no padding is trained), drawn in a permutation
seeded by (seed, epoch). In a multi-process run the windows are a `host_data.PackedWindows`
(each process tokenized only its own rows): the same windows in the same order, gathered on the
mesh, with the parameters replicated over it.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from dspark_jax import parallel
from dspark_jax.config import TargetConfig, TrainConfig
from dspark_jax.models.transformer import forward, init_params
from dspark_jax.runtime.xla_cpu import training_compiler_options
from dspark_jax.storage import as_path
from dspark_jax.train.checkpoint import Checkpointer, abstract_like
from dspark_jax.train.host_data import PackedWindows
from dspark_jax.train.optimizer import make_optimizer


def pack_windows(token_lists, seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut [N, seq_len + 1] windows (inputs + shifted labels)."""
    flat = np.concatenate([np.asarray(t, np.int32) for t in token_lists])
    n = (len(flat) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"not enough text to train the target: {len(flat)} tokens < seq_len + 1 = {seq_len + 1}"
        )
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return flat[idx]


def _loss(cfg: TargetConfig, params, windows_BxT1):
    x = windows_BxT1[:, :-1]
    y = windows_BxT1[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
    out, _ = forward(cfg, params, x, pos, None)
    logp = jax.nn.log_softmax(out.logits, -1)
    nll = -jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
    return jnp.mean(nll)


def _step(cfg, opt, params, opt_state, batch):
    loss, grads = jax.value_and_grad(functools.partial(_loss, cfg))(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.cache
def _step_jit(options: tuple, out_sharding=None):
    """The jitted step, compiled with the training compiler options (`xla_cpu.py`); with
    `out_sharding` (per-host windows), its outputs stay replicated on that mesh."""
    kw = {} if out_sharding is None else {"out_shardings": out_sharding}
    return jax.jit(_step, static_argnums=(0, 1), donate_argnums=(2, 3),
                   compiler_options=dict(options) or None, **kw)  # fmt: skip


def train_lm(
    cfg: TargetConfig,
    token_lists,
    tc: TrainConfig,
    run_dir: str | os.PathLike,
    *,
    heldout_token_lists=None,
    progress: bool = True,
):
    """Train a target from scratch (or resume from `run_dir/ckpt`). Returns (params, log).

    Reads from `tc`: the optimizer fields, `total_steps` steps of `global_batch_size` windows of
    `max(seq_buckets)` tokens, `seed` (init and data order), `checkpoint_interval`, the loss logged
    every `log_interval` steps, and `max_eval_batches` batches of held-out windows.
    `token_lists` (and `heldout_token_lists`) may instead be `host_data.PackedWindows` of
    `max(seq_buckets)` (per-host data, module docstring)."""
    run_dir = as_path(run_dir)  # a local path or a bucket URL
    seq_len, batch_size, steps = max(tc.seq_buckets), tc.global_batch_size, tc.total_steps
    per_host = isinstance(token_lists, PackedWindows)
    windows = token_lists if per_host else pack_windows(token_lists, seq_len)
    if len(windows) < batch_size:
        raise ValueError(
            f"only {len(windows)} windows of {seq_len} tokens for batch_size={batch_size}"
        )
    opt = make_optimizer(tc, steps)
    params = init_params(cfg, tc.seed)
    repl = parallel.replicated(windows.mesh) if per_host else None
    if per_host:
        params = parallel.put(params, jax.tree.map(lambda _: repl, params))
        opt_state = jax.jit(opt.init, out_shardings=repl)(params)
    else:
        opt_state = opt.init(params)
    # per host: a background save's barriers are device collectives (orbax's sync_global_devices)
    # issued from another thread, so they could interleave with the steps' collectives in
    # another order on each process
    ckpt = Checkpointer(run_dir / "ckpt", max_to_keep=1, async_save=not per_host)
    start = 0
    restored = ckpt.restore(abstract_like({"params": params, "opt": opt_state}))
    if restored is not None:
        start, state, _ = restored
        params, opt_state = state["params"], state["opt"]
    per_epoch = len(windows) // batch_size

    def batch_at(step, after):
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([tc.seed, epoch]).permutation(len(windows))
        picked = order[i * batch_size : (i + 1) * batch_size]
        # per host: gathered on the mesh once the previous step has run (`host_data.in_order`)
        return windows.take(picked, after) if per_host else jnp.asarray(windows[picked])

    step_fn = _step_jit(tuple((training_compiler_options() or {}).items()), repl)
    log = []
    bar = tqdm(total=steps, initial=start, desc="target", disable=not progress, unit="step")
    loss = None
    for step in range(start, steps):
        params, opt_state, loss = step_fn(cfg, opt, params, opt_state, batch_at(step, loss))
        if step % tc.log_interval == 0 or step == steps - 1:
            lv = float(loss)
            log.append({"step": step, "loss": lv})
            bar.set_postfix(loss=f"{lv:.3f}")
        bar.update(1)
        every = tc.checkpoint_interval
        if every and (step + 1) % every == 0 and step + 1 < steps:
            ckpt.save(step + 1, {"params": params, "opt": opt_state}, {"kind": "target"})
    bar.close()
    ckpt.close()
    if isinstance(heldout_token_lists, PackedWindows):
        n = min(len(heldout_token_lists), tc.max_eval_batches * batch_size)
        hw = heldout_token_lists.take(np.arange(n), loss)
    elif heldout_token_lists:
        hw = jnp.asarray(
            pack_windows(heldout_token_lists, seq_len)[: tc.max_eval_batches * batch_size]
        )
    if heldout_token_lists:
        ev = jax.jit(functools.partial(_loss, cfg))
        log.append({"heldout_loss": float(ev(params, hw))})
    if per_host:  # replicated: every process's own copy, as a one-process run returns them
        params = jax.tree.map(lambda x: x.addressable_data(0), params)
    return params, log
