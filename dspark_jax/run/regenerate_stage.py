"""The regenerate stage of `train.py`'s pipeline (`Pipeline._stage_regenerate` delegates here):
the target answers the training prompts (docs/METHOD.md §1.2), so drafters learn the target's own
outputs. Each function takes the `Pipeline` (`p`) for its config, loaders and log.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from dspark_jax import parallel
from dspark_jax.engine.memory import plan_decode_memory
from dspark_jax.errors import ConfigError
from dspark_jax.io import atomic_write
from dspark_jax.models.generate import generate
from dspark_jax.models.hf import load_target
from dspark_jax.run.rundir import LENGTH_BUCKETS
from dspark_jax.templates import encode_prompt
from dspark_jax.train.memory import HEADROOM, _gib


def run_regenerate(p) -> dict:
    """The regenerate stage's body: the target answers the training prompts turn by turn;
    written as shards of JSONL conversations (resumable; one set per process)."""
    c = p.cfg.regenerate
    tcfg, tparams = regen_target(p)
    tok = p.tokenizer()
    order = p._regen_order()  # the rows answered, in order: row id = position in this order
    stop = p.stop_ids()
    ctx = tcfg.max_position_embeddings
    buckets = tuple(b for b in LENGTH_BUCKETS if b <= ctx)
    check_regen_memory(p, tcfg, tparams, max(_row_buckets(c.batch_size)), min(max(buckets), ctx))
    shard_dir = p.durable_dir("regenerate") / "shards"  # every process writes its shards
    shard_dir.mkdir(parents=True, exist_ok=True)
    shard = max(c.batch_size, 1) * c.shard_batches
    # multi-process: process k regenerates shards s % n == k into <s>.p<k>.jsonl, reading only
    # their rows
    pi, pn = jax.process_index(), jax.process_count()
    mine = [lo for lo in range(0, len(order), shard) if (lo // shard) % pn == pi]
    todo = [lo for lo in mine if not any(shard_dir.glob(f"{lo // shard:05d}.*jsonl"))]
    requests = p._regen_requests(np.concatenate([order[lo : lo + shard] for lo in todo] or [[]]))
    p.log(f"  regenerate: {len(order)} rows in {-(-len(order) // shard)} shard(s); this "
          f"process reads {sum(len(order[lo : lo + shard]) for lo in todo)} row(s), "
          f"{len(requests)} usable")  # fmt: skip
    bar = tqdm(total=sum(len(order[lo : lo + shard]) for lo in mine), desc="regenerate",
               unit="prompt")  # fmt: skip
    for lo in mine:
        s = lo // shard
        path = shard_dir / (f"{s:05d}.jsonl" if pn == 1 else f"{s:05d}.p{pi}.jsonl")
        if lo not in todo:  # resumed: finished before (any process)
            bar.update(len(order[lo : lo + shard]))
            continue
        # (position, request) of the shard's usable rows
        pos = [q for q in range(lo, min(lo + shard, len(order))) if int(order[q]) in requests]
        got = [requests[int(order[q])] for q in pos]
        chunk = [t for _, t in got]
        # the sample's own system message is sent with every turn (docs/METHOD.md §1.2)
        msgs = [[{"role": "system", "content": sys_}] if sys_ else [] for sys_, _ in got]
        max_turns = max((len(t) for t in chunk), default=0)
        for turn in range(max_turns):  # multi-turn prompts answered turn by turn
            idx = [i for i, t in enumerate(chunk) if len(t) > turn]
            for i in idx:
                msgs[i].append({"role": "user", "content": chunk[i][turn]})
            toks = [list(encode_prompt(tok, msgs[i])) for i in idx]
            keep = [j for j, t in enumerate(toks) if len(t) + c.max_new_tokens <= ctx]
            outs = generate(
                tcfg, tparams, [toks[j] for j in keep], max_new_tokens=c.max_new_tokens,
                sampling={"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k},
                stop_ids=stop, seeds=[c.seed + pos[idx[j]] for j in keep],
                # a row that finishes takes the next prompt (models/generate_queue.py); a small
                # group of long prompts runs through fewer rows
                batch_buckets=_row_buckets(c.batch_size), length_buckets=buckets, loop="queue",
            )  # fmt: skip
            for j, out in zip(keep, outs):
                text = tok.decode([t for t in out if t not in stop], skip_special_tokens=True)
                msgs[idx[j]].append({"role": "assistant", "content": text.strip() or "."})
        rows = [
            {"id": pos[i], "conversations": m}
            for i, m in enumerate(msgs)
            if m and m[-1]["role"] == "assistant"
        ]
        with atomic_write(path) as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        bar.update(len(order[lo : lo + shard]))
    bar.close()
    if pn > 1:  # every process's shards are written before anyone reads them
        multihost_utils.sync_global_devices("regenerate shards written")
    return {"prompts": len(order)}


def check_regen_memory(p, tcfg, tparams, rows: int, cache_len: int) -> None:
    """Print the decoding's memory plan per device; refuse one that cannot fit before any
    prompt is decoded (the limit: `drafters.train.device_memory_gib`, else what the devices
    report)."""
    limit_gib = p.cfg.drafters.train.device_memory_gib
    plan = plan_decode_memory(tcfg, tparams, rows, cache_len, limit_gib)
    p.log(f"  regenerate: {rows} rows x {cache_len} positions; {plan.summary()}")
    if not plan.fits:
        raise ConfigError(
            f"regeneration needs ~{_gib(plan.total)} per device ({plan.parts()}) but the devices "
            f"have {_gib(plan.limit)} ({HEADROOM:.0%} usable): lower regenerate.batch_size or "
            "regenerate.max_new_tokens, load the target in bf16 (drafters.train.target_dtype=bfloat16), or shard "
            "it over more devices (a larger mesh.tensor)"
        )


def regen_target(p):
    """The target for regeneration: the run's (on the pipeline's mesh) in a single-process
    run; with several processes each one regenerates different prompts, so each holds its
    own copy on its local devices (`parallel.local_mesh`)."""
    if jax.process_count() == 1:
        return p.target()
    if "regen_target" not in p.rundir._cache:
        p.rundir._cache["regen_target"] = load_target(
            p.rundir.local_path(p.rundir.target_path(), "target"),
            mesh=parallel.local_mesh(p.cfg.mesh),
            target_layer_ids=p.cfg.target.target_layer_ids or None,
            dtype=p.rundir.target_dtype(),
        )  # fmt: skip
    return p.rundir._cache["regen_target"]


def _row_buckets(batch_size: int) -> tuple[int, ...]:
    """Decode-row counts for the regeneration queues: batch_size, and a quarter of it for the small
    groups (long prompts; a second turn)."""
    return tuple(sorted({max(int(batch_size) // 4, 1), max(int(batch_size), 1)}))
