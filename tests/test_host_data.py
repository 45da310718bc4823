"""Per-host data: two real processes joined by jax.distributed on localhost each read only
their own block of a JSONL file and of a TFDS split, and the global batch assembled from their
rows is the one-process batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from host_data_subprocess import tokens

from dspark_jax.train.data import (
    Conversation,
    process_block,
    read_conversations,
    write_conversations,
)
from dspark_jax.train.data_tfds import read_tfds
from tests.procs import free_port, wait_all

HERE = Path(__file__).parent


def test_process_blocks_cover_every_row_once_in_order():
    for n in range(9):
        for p in (1, 2, 3, 4):
            blocks = [process_block(n, k, p) for k in range(p)]
            assert [i for b in blocks for i in b] == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    with pytest.raises(ValueError, match="process index 2 must be in 0 .. 1"):
        process_block(4, 2, 2)


def test_two_processes_read_their_own_rows_and_assemble_the_one_process_batch(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    from test_tfds import DsparkTinyChats

    tfds_dir = str(tmp_path / "tfds")
    DsparkTinyChats(data_dir=tfds_dir, file_format="array_record").download_and_prepare()
    jsonl = tmp_path / "chats.jsonl"
    write_conversations(
        jsonl, [Conversation.from_pairs(("user", f"question {i}?"), ("assistant", f"{i}"))
                for i in range(6)]
    )  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    port, outs, procs = free_port(), [tmp_path / f"p{i}.json" for i in range(2)], []
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    for i in range(2):
        cmd = [sys.executable, str(HERE / "host_data_subprocess.py"), str(outs[i]), str(port),
               str(i), str(jsonl), tfds_dir]  # fmt: skip
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    wait_all(procs, 300, logs)
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    one, _ = read_conversations(jsonl)
    assert r0["conv_ids"] == [0, 1, 2] and r1["conv_ids"] == [3, 4, 5]
    assert r0["shape"] == [6, 24] and r0["batch"] == r1["batch"] == tokens(one).tolist()
    whole, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=tfds_dir)
    assert r0["tfds_ids"] + r1["tfds_ids"] == [c.id for c in whole]
    assert not set(r0["tfds_ids"]) & set(r1["tfds_ids"])
