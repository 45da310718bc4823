"""One of two processes joined by jax.distributed over loopback (2 CPU devices each), reading
only its own block of a JSONL file and of a TFDS split, tokenizing those rows only, and
assembling the global batch with `parallel.global_batch` (`tests/test_host_data.py`); then the
batch builders of the pipeline's training stages (`train.host_data`) over its own block of a
second JSONL file, tokenized with a real tokenizer, with the target's features computed per host
(offline features, `HostShards`).

python tests/host_data_subprocess.py OUT_JSON PORT PROCESS_ID JSONL TFDS_DATA_DIR CHATS TOKENIZER
(TFDS_DATA_DIR "" skips the TFDS read)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

# the pipeline builders' settings, shared with the one-process reference in the test
TRAIN = dict(global_batch_size=8, micro_batch_size=4, eval_batch_size=4, seq_buckets=(48, 96))
N_EVAL, SEQ_LEN, STEPS = 5, 32, 3


def tokens(convs, length: int = 24) -> np.ndarray:
    """[len(convs), length] int32: the first user turn's bytes, right-padded with 0."""
    out = np.zeros((len(convs), length), np.int32)
    for i, c in enumerate(convs):
        ids = np.frombuffer(c.user_turns()[0].encode()[:length], np.uint8)
        out[i, : len(ids)] = ids
    return out


def render():
    from dspark_jax.templates import RenderConfig

    return RenderConfig(max_length=max(TRAIN["seq_buckets"]), min_loss_tokens=5)


def plan(mesh, train_data, eval_data):
    """The drafters' Trainer's data plan (`steps.plan_data`) and its batches: the micro-batches
    of the first `STEPS` steps, then the held-out batches, each as {field: [B, L] array}."""
    from dspark_jax.config import TrainConfig
    from dspark_jax.train import steps

    cfg = TrainConfig(**TRAIN, pad_id=3)
    data = steps.plan_data(cfg, mesh, train_data, eval_data)
    mbs = [mb for s in range(STEPS) for mb in data.loader.micro_batches(s * cfg.global_batch_size)]
    out = [steps.device_batch(mesh, data.train_source, mb, cfg.pad_id) for mb in mbs]
    return out + [steps.device_batch(mesh, data.eval_source, mb, cfg.pad_id)
                  for mb in data.eval_plan]  # fmt: skip


def window_order(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample order of the packed stream, windows of one batch): as the target stage draws."""
    return np.random.default_rng(0).permutation(n), np.array([5, 0, 2, 7, 1, 3, 4, 6])


def pipeline_batches(mesh, chats: str, tok_dir: str, shard) -> dict:
    from jax.experimental import multihost_utils

    from dspark_jax.models.hf import load_tokenizer
    from dspark_jax.train.data import encode_conversations, read_conversations
    from dspark_jax.train.host_data import HostTable, per_host_layout

    convs, _ = read_conversations(chats, keep_system=True, shard=shard)
    samples, stats = encode_conversations(load_tokenizer(tok_dir), convs, render())
    table = HostTable.of(mesh, [samples])
    batches = plan(mesh, table.source(np.arange(N_EVAL, table.size)),
                   table.source(np.arange(N_EVAL)))  # fmt: skip
    order, picked = window_order(table.size)
    windows = table.windows(order, SEQ_LEN).take(picked)

    def host(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()

    return {"per_host": per_host_layout(mesh), "read": [c.id for c in convs],
            "tokenized": stats.read, "size": table.size, "windows": host(windows),
            "batches": [{k: host(v) for k, v in b.items()} for b in batches]}  # fmt: skip


def feature_target():
    """The tiny target whose features both the processes and the test's reference compute."""
    from dspark_jax.testing import random_params, tiny_target_config

    cfg = tiny_target_config(vocab_size=512)
    return cfg, random_params(cfg, 0)


def offline_split(samples, k: int):
    """(held-out, training) samples of process k's block: it holds out its share of N_EVAL."""
    from dspark_jax.train.data import process_block

    n = len(process_block(N_EVAL, k, 2))
    return samples[:n], samples[n:]


def offline_batches(mesh, chats: str, tok_dir: str, shard, cache_dir: str) -> dict:
    """Offline features per host: this process's own block tokenized, its features computed in
    this process alone into its own caches, read as `HostShards`; the Trainer's batches."""
    from jax.experimental import multihost_utils

    from dspark_jax.models.hf import load_tokenizer
    from dspark_jax.train.data import encode_conversations, read_conversations
    from dspark_jax.train.features import write_feature_cache
    from dspark_jax.train.host_data import HostShards

    convs, _ = read_conversations(chats, keep_system=True, shard=shard)
    samples, _ = encode_conversations(load_tokenizer(tok_dir), convs, render())
    held, train = offline_split(samples, shard[0])
    tcfg, params = feature_target()
    kw = dict(buckets=TRAIN["seq_buckets"], batch_size=2, dtype="float32", process_index=0,
              process_count=1)  # fmt: skip
    src = {name: HostShards(write_feature_cache(f"{cache_dir}/p{shard[0]}/{name}", tcfg, params,
                                                part, **kw))
           for name, part in (("train", train), ("eval", held))}  # fmt: skip
    from dspark_jax.config import TrainConfig
    from dspark_jax.train import steps

    cfg = TrainConfig(**TRAIN, pad_id=3, feature_mode="offline")
    data = steps.plan_data(cfg, mesh, src["train"], src["eval"])
    mbs = [("train", mb) for s in range(STEPS)
           for mb in data.loader.micro_batches(s * cfg.global_batch_size)]  # fmt: skip
    mbs += [("eval", mb) for mb in data.eval_plan]

    def host(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist()

    out = []
    for name, mb in mbs:
        b = steps.device_batch(mesh, src[name], mb, cfg.pad_id)
        out.append({"source": name, "indices": mb.indices.tolist(), "length": mb.length,
                    **{k: host(v) for k, v in b.items()}})  # fmt: skip
    return {"cached": {k: len(v.local) for k, v in src.items()}, "batches": out}


def main(out_json, port, pid, jsonl, tfds_dir, chats, tok_dir) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)  # fmt: skip
    from jax.experimental import multihost_utils

    from dspark_jax import parallel
    from dspark_jax.config import MeshConfig
    from dspark_jax.train.data import read_conversations
    from dspark_jax.train.data_tfds import read_tfds

    shard = (jax.process_index(), jax.process_count())
    convs, _ = read_conversations(jsonl, shard=shard)
    chats_read = []
    if tfds_dir:
        chats_read, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=tfds_dir, shard=shard)
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2))
    batch = parallel.global_batch(mesh, tokens(convs), batch=2 * len(convs))
    got = multihost_utils.process_allgather(batch, tiled=True)
    out = {"conv_ids": [c.id for c in convs], "tfds_ids": [c.id for c in chats_read],
           "batch": np.asarray(got).tolist(), "shape": list(batch.shape)}  # fmt: skip
    # the pipeline's mesh in tests/test_multiprocess_stages.py: fsdp across the processes
    out["pipeline"] = pipeline_batches(parallel.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2)),
                                       chats, tok_dir, shard)  # fmt: skip
    out["offline"] = offline_batches(parallel.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2)),
                                     chats, tok_dir, shard, str(Path(out_json).parent / "feats"))  # fmt: skip
    with open(out_json, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:8])
