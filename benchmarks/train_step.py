"""Training throughput of DSpark, DFlash and Eagle3 on the tiny target, online vs offline features.

Prints ONE JSON object:

* ``{kind}_{mode}_tokens_per_s``: real (unpadded) training tokens per second through the full
  trainer loop (data loading, micro-steps, optimizer update), ``mode`` in ``online`` (frozen
  target inside the jitted step) and ``offline`` (bf16 feature cache read from disk);
* ``{kind}_{mode}_anchors_per_s``: DSpark/DFlash anchor blocks per second (valid blocks, the
  ``n_blocks`` metric); Eagle3: supervised positions per second (each starts a TTT chain);
* baseline in the same run: ``{kind}_offline_over_online`` = offline / online tokens per second;
* ``{kind}_compiles``: compilations of the micro-step per feature mode (one per sequence bucket
  met), of the update step (one per drafter: the offline run reuses the online run's update,
  which has the same shapes), and during the timed steps (must be 0); ``compiles_per_bucket`` is
  the maximum micro-step compilations per bucket over all runs (must be 1);
* ``cache_build_s`` / ``cache_mb``: building the offline cache (not in the step timings).

    python benchmarks/train_step.py [--steps 16] [--dtype float32] [--micro-batch 4]
    python benchmarks/train_step.py --smoke   # seconds: the same path and keys; 1 timed step,
                                              # micro-batch 2, no accumulation, 16 sequences
                                              # of 24..64 tokens (one bucket met), γ = 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import numpy as np

from dspark_jax import parallel
from dspark_jax.config import DrafterConfig, MeshConfig, TrainConfig
from dspark_jax.models import transformer
from dspark_jax.testing import CompileCounter, tiny_target_config
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.features import write_feature_cache
from dspark_jax.train.trainer import Trainer

BUCKETS = (64, 128)


def samples(n: int, vocab: int, seed: int = 0, lengths=(40, 128)) -> list[TokenizedSample]:
    """Sequences of 40..128 tokens (two buckets) with a supervised second half."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = rng.integers(0, vocab, length).astype(np.int32)
        mask = np.zeros(length, np.uint8)
        mask[length // 2 :] = 1
        out.append(TokenizedSample(ids, mask, id=i))
    return out


def drafter(kind: str, target, block: int = 7, anchors: int = 16) -> DrafterConfig:
    small = dict(num_layers=1, block_size=block)
    if kind == "eagle3":
        return DrafterConfig.eagle3(target, block_size=block)
    mask = target.vocab_size - 1
    if kind == "dflash":
        return DrafterConfig.dflash(target, **small, num_anchors=anchors, mask_token_id=mask)
    return DrafterConfig.dspark(
        target, **small, num_anchors=anchors, mask_token_id=mask, markov_rank=32
    )


def warmup_steps(trainer: Trainer, minimum: int) -> int:
    """Enough steps to meet every bucket the data has (all compilations happen in warm-up)."""
    g = trainer.cfg.global_batch_size
    want = {
        mb.length for s in range(trainer.total_steps) for mb in trainer.loader.micro_batches(s * g)
    }
    seen, k = set(), 0
    while seen != want:
        seen |= {mb.length for mb in trainer.loader.micro_batches(k * g)}
        k += 1
    return max(k, minimum)


def bench(kind, mode, target_cfg, target_params, data, cfg, mesh, steps, workdir, dkw) -> dict:
    dcfg = drafter(kind, target_cfg, **dkw).replace(dtype=cfg.compute_dtype)
    t = Trainer.for_drafter(
        cfg,
        dcfg,
        target_params,
        train_data=data,
        run_dir=os.path.join(workdir, f"{kind}_{mode}"),
        mesh=mesh,
    )
    with CompileCounter() as warm:
        t.run(max_steps=warmup_steps(t, 2), save_at_end=False)
    with CompileCounter() as timed:
        res = t.run(max_steps=steps, save_at_end=False)
    g = cfg.global_batch_size
    buckets = {mb.length for s in range(t.step) for mb in t.loader.micro_batches(s * g)}
    key = "n_supervised" if kind == "eagle3" else "n_blocks"
    anchors = sum(h[key] for h in res.history) * cfg.accum_steps  # metric = mean per micro-batch
    names = warm.names + timed.names
    t.close()
    return {
        "tokens_per_s": res.tokens / res.seconds,
        "anchors_per_s": anchors / res.seconds,
        "step_ms": 1000 * res.seconds / steps,
        "_compiles": {
            f"{mode}_micro_step": names.count("jit(train_micro_step)"),
            f"{mode}_buckets": len(buckets),
            f"{mode}_update": names.count("jit(train_apply_step)"),
            f"{mode}_during_timed_steps": timed.count,
        },
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--kinds", default="dspark,dflash,eagle3")
    ap.add_argument("--smoke", action="store_true", help="seconds-sized run, the same keys")
    args = ap.parse_args(argv)
    n_samples, lengths, dkw = 256, (40, 128), {}
    drafters_doc = "1 layer, block 7, 16 anchors/sequence (DSpark/DFlash), Markov r=32"
    if args.smoke:
        args.steps, args.micro_batch, args.accum = 1, 2, 1
        n_samples, lengths, dkw = 16, (24, BUCKETS[0]), dict(block=2, anchors=4)
        drafters_doc = "1 layer, block 2, 4 anchors/sequence (DSpark/DFlash), Markov r=32"
    target_cfg = tiny_target_config(max_position_embeddings=256)
    target_params = transformer.init_params(target_cfg, 0)
    mesh = parallel.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    cfg = TrainConfig(
        global_batch_size=args.micro_batch * args.accum,
        micro_batch_size=args.micro_batch,
        seq_buckets=BUCKETS,
        total_steps=1000,
        compute_dtype=args.dtype,
        eval_interval=0,
        checkpoint_interval=0,
        log_interval=0,
        progress_bar=False,
    )
    data = samples(n_samples, target_cfg.vocab_size, lengths=lengths)
    out: dict = {
        "benchmark": "train_step",
        "target": "tiny_target_config (4 layers, H=64, V=256, 3 feature layers)",
        "drafters": drafters_doc,
        "global_batch": cfg.global_batch_size,
        "micro_batch": cfg.micro_batch_size,
        "buckets": list(BUCKETS),
        "dtype": args.dtype,
        "steps_timed": args.steps,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        cache = write_feature_cache(
            os.path.join(work, "cache"),
            target_cfg,
            target_params,
            data,
            chunk_size=64,
            batch_size=8,
            buckets=BUCKETS,
            dtype="bfloat16",
        )
        out["cache_build_s"] = time.perf_counter() - t0
        size = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(work, "cache"))
            for f in fs
        )
        out["cache_mb"] = size / 2**20
        per_bucket = []
        for kind in args.kinds.split(","):
            compiles: dict = {}
            for mode, train in (("online", data), ("offline", cache)):
                r = bench(
                    kind,
                    mode,
                    target_cfg,
                    target_params,
                    train,
                    cfg.replace(feature_mode=mode),
                    mesh,
                    args.steps,
                    work,
                    dkw,
                )
                c = r.pop("_compiles")
                compiles.update(c)
                per_bucket.append(c[f"{mode}_micro_step"] / c[f"{mode}_buckets"])
                for k, v in r.items():
                    out[f"{kind}_{mode}_{k}"] = v
            compiles["update"] = compiles.pop("online_update") + compiles.pop("offline_update")
            out[f"{kind}_compiles"] = compiles
            out[f"{kind}_offline_over_online"] = (
                out[f"{kind}_offline_tokens_per_s"] / out[f"{kind}_online_tokens_per_s"]
            )
        out["compiles_per_bucket"] = max(per_bucket)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
