"""One of two processes joined by jax.distributed over loopback (2 CPU devices each), reading
only its own block of a JSONL file and of a TFDS split, tokenizing those rows only, and
assembling the global batch with `parallel.global_batch` (`tests/test_host_data.py`).

python tests/host_data_subprocess.py OUT_JSON PORT PROCESS_ID JSONL TFDS_DATA_DIR
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np


def tokens(convs, length: int = 24) -> np.ndarray:
    """[len(convs), length] int32: the first user turn's bytes, right-padded with 0."""
    out = np.zeros((len(convs), length), np.int32)
    for i, c in enumerate(convs):
        ids = np.frombuffer(c.user_turns()[0].encode()[:length], np.uint8)
        out[i, : len(ids)] = ids
    return out


def main(out_json: str, port: int, pid: int, jsonl: str, tfds_dir: str) -> None:
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)  # fmt: skip
    from jax.experimental import multihost_utils

    from dspark_jax import parallel
    from dspark_jax.config import MeshConfig
    from dspark_jax.train.data import read_conversations
    from dspark_jax.train.data_tfds import read_tfds

    shard = (jax.process_index(), jax.process_count())
    convs, _ = read_conversations(jsonl, shard=shard)
    chats, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=tfds_dir, shard=shard)
    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2))
    batch = parallel.global_batch(mesh, tokens(convs), batch=2 * len(convs))
    got = multihost_utils.process_allgather(batch, tiled=True)
    out = {"conv_ids": [c.id for c in convs], "tfds_ids": [c.id for c in chats],
           "batch": np.asarray(got).tolist(), "shape": list(batch.shape)}  # fmt: skip
    with open(out_json, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
