"""Per-host data: two real processes joined by jax.distributed on localhost each read only
their own block of a JSONL file and of a TFDS split, and the global batch assembled from their
rows is the one-process batch; the pipeline's training batch builders (`train.host_data`) give
the one-process batches from the rows each process tokenized."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import host_data_subprocess as hds
import jax
import numpy as np
import pytest
from host_data_subprocess import tokens

from dspark_jax import parallel
from dspark_jax.config import MeshConfig
from dspark_jax.models.hf import load_tokenizer
from dspark_jax.testing import tiny_tokenizer
from dspark_jax.train.data import (
    Conversation,
    encode_conversations,
    process_block,
    read_conversations,
    write_conversations,
)
from dspark_jax.train.data_tfds import read_tfds
from dspark_jax.train.lm import pack_windows
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


def _chats() -> list[Conversation]:
    """Conversations of uneven lengths; every fifth answer too short to keep (min_loss_tokens)."""
    out = []
    for i in range(23):
        answer = "ok" if i % 5 == 4 else " ".join(["the answer is", str(i)] * (1 + i % 4))
        out.append(Conversation.from_pairs(("user", f"question {i} " * (1 + i % 3)),
                                           ("assistant", answer)))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Both processes' results (host_data_subprocess.py), run once for the tests below."""
    tmp = tmp_path_factory.mktemp("host_data")
    tfds_dir = ""
    try:
        from test_tfds import DsparkTinyChats

        tfds_dir = str(tmp / "tfds")
        DsparkTinyChats(data_dir=tfds_dir, file_format="array_record").download_and_prepare()
    except ImportError:  # no tensorflow_datasets: the TFDS read is skipped
        pass
    jsonl, chats = tmp / "chats.jsonl", tmp / "regenerated.jsonl"
    write_conversations(
        jsonl, [Conversation.from_pairs(("user", f"question {i}?"), ("assistant", f"{i}"))
                for i in range(6)]
    )  # fmt: skip
    write_conversations(chats, _chats())
    tok_dir = tiny_tokenizer(tmp / "tok").name_or_path
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    port, outs, procs = free_port(), [tmp / f"p{i}.json" for i in range(2)], []
    logs = [tmp / f"p{i}.log" for i in range(2)]
    for i in range(2):
        cmd = [sys.executable, str(HERE / "host_data_subprocess.py"), str(outs[i]), str(port),
               str(i), str(jsonl), tfds_dir, str(chats), tok_dir]  # fmt: skip
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    wait_all(procs, 300, logs)
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    return r0, r1, jsonl, chats, tfds_dir, tok_dir


def test_two_processes_read_their_own_rows_and_assemble_the_one_process_batch(two_processes):
    r0, r1, jsonl, _, tfds_dir, _ = two_processes
    one, _ = read_conversations(jsonl)
    assert r0["conv_ids"] == [0, 1, 2] and r1["conv_ids"] == [3, 4, 5]
    assert r0["shape"] == [6, 24] and r0["batch"] == r1["batch"] == tokens(one).tolist()
    if not tfds_dir:
        pytest.skip("tensorflow_datasets is not installed: the TFDS half is not checked")
    whole, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=tfds_dir)
    assert r0["tfds_ids"] + r1["tfds_ids"] == [c.id for c in whole]
    assert not set(r0["tfds_ids"]) & set(r1["tfds_ids"])


def test_pipeline_batches_on_two_processes_are_the_one_process_batches(two_processes):
    """The drafters' Trainer batches (train and held-out) and the target's packed windows, built
    by `train.host_data` from the rows each process tokenized, equal the one-process builders'
    (`steps.device_batch` over every sample, `lm.pack_windows`), field by field."""
    r0, r1, _, chats, _, tok_dir = two_processes
    p0, p1 = r0["pipeline"], r1["pipeline"]
    assert p0["per_host"] and p1["per_host"]
    # each process read and tokenized only its own block of the 23 rows
    assert p0["read"] == list(range(11)) and p1["read"] == list(range(11, 23))
    assert (p0["tokenized"], p1["tokenized"]) == (11, 12)

    convs, _ = read_conversations(chats, keep_system=True)
    samples, _ = encode_conversations(load_tokenizer(tok_dir), convs, hds.render())
    assert p0["size"] == p1["size"] == len(samples) == 19  # 4 answers too short, both ways
    one_device = parallel.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    want = hds.plan(one_device, samples[hds.N_EVAL :], samples[: hds.N_EVAL])
    assert len(p0["batches"]) == len(want) == 3 * 2 + 2
    for got0, got1, w in zip(p0["batches"], p1["batches"], want):
        assert got0 == got1 and set(got0) == set(w)
        for k, v in w.items():
            np.testing.assert_array_equal(np.asarray(got0[k]), np.asarray(v), err_msg=k)
    order, picked = hds.window_order(len(samples))
    windows = pack_windows([samples[i].input_ids for i in order], hds.SEQ_LEN)
    assert p0["windows"] == p1["windows"] == windows[picked].tolist()


def test_offline_features_per_host_each_process_computes_and_reads_only_its_rows(
    two_processes, tmp_path
):
    """Offline features on two processes: each computes the target's features of its own block
    only (its held-out share and the rest), and every batch's rows on process k come from its
    block; the batches hold the features a one-process cache of the same samples holds."""
    from dspark_jax.train.features import write_feature_cache
    from dspark_jax.train.loader import MicroBatch, load_rows

    r0, r1, _, chats, _, tok_dir = two_processes
    o0, o1 = r0["offline"], r1["offline"]
    convs, _ = read_conversations(chats, keep_system=True)
    samples, _ = encode_conversations(load_tokenizer(tok_dir), convs, hds.render())
    blocks = [samples[: 11 - 2], samples[11 - 2 :]]  # 11 / 12 rows read; 2 + 2 answers too short
    assert sum(map(len, blocks)) == 19
    splits = [hds.offline_split(b, k) for k, b in enumerate(blocks)]
    assert o0["cached"] == {"train": len(splits[0][1]), "eval": len(splits[0][0])}
    assert o1["cached"] == {"train": len(splits[1][1]), "eval": len(splits[1][0])}
    tcfg, params = hds.feature_target()
    kw = dict(buckets=hds.TRAIN["seq_buckets"], batch_size=2, dtype="float32")
    one = {name: write_feature_cache(tmp_path / name, tcfg, params,
                                     splits[0][i] + splits[1][i], **kw)
           for i, name in ((1, "train"), (0, "eval"))}  # fmt: skip
    firsts = {"train": len(splits[0][1]), "eval": len(splits[0][0])}
    assert len(o0["batches"]) == 3 * 2 + 2  # held out: 2 and 3 rows, 2 per process a batch
    for b0, b1 in zip(o0["batches"], o1["batches"]):
        assert b0 == b1
        idx = np.asarray(b0["indices"])
        half = len(idx) // 2  # rows of process 0's devices, then process 1's
        real = idx >= 0
        assert (idx[:half][real[:half]] < firsts[b0["source"]]).all()
        assert (idx[half:][real[half:]] >= firsts[b0["source"]]).all()
        want = load_rows(one[b0["source"]], MicroBatch(idx, b0["length"]), pad_id=3)
        assert set(want) == set(b0) - {"source", "indices", "length"}
        for k, v in want.items():
            np.testing.assert_allclose(np.asarray(b0[k], np.float32), v.astype(np.float32),
                                       rtol=1e-5, atol=1e-5, err_msg=k)  # fmt: skip


def test_the_batch_gathers_compile_to_one_all_reduce_and_no_permute():
    """Both per-host gathers (the target's windows, the drafters' rows) on a 2 x 2 x 2 mesh:
    one all-reduce each and no collective-permute (XLA's own lowering of `table[rows, cols]`
    had two permutes, and two processes hung in them now and then)."""
    import re

    from dspark_jax.train import host_data

    mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    table = jax.device_put(np.arange(64 * 40, dtype=np.int32).reshape(64, 40),
                           parallel.batch_sharding(mesh, (64, 40)))  # fmt: skip
    mask = jax.device_put(np.ones((64, 40), np.uint8), table.sharding)
    out = parallel.batch_sharding(mesh, (8, 17))
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 64, (8, 17)).astype(np.int32)
    cols = rng.integers(0, 40, (8, 17)).astype(np.int32)
    after = np.zeros((), np.int32)
    windows = host_data._windows_program(table.sharding, out)
    np.testing.assert_array_equal(np.asarray(windows(table, rows, cols, after)),
                                  np.asarray(table)[rows, cols])  # fmt: skip
    rows_fn = host_data._rows_program(17, table.sharding, out)
    rows_args = (table, mask, rows[:, 0], np.full(8, 17, np.int32), np.int32(0), after)
    for fn, args in ((windows, (table, rows, cols, after)), (rows_fn, rows_args)):
        hlo = fn.lower(*args).compile().as_text()
        assert len(re.findall(r"all-reduce(-start)?\(", hlo)) == 1
        assert "collective-permute" not in hlo
