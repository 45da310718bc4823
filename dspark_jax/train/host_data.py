"""Per-host training data (issue 40): in a multi-process run each process reads and tokenizes
only its own block of the rows (`data.process_block`); the tokenized rows of every process form
one global token table on the mesh (`parallel.global_batch`: no process reads or sends another's
rows), and the batches are gathered from that table on the devices in the one-process order.
So a multi-process run trains on exactly the batches of the one-process run.

    table = HostTable.of(mesh, [samples_of_source_0, samples_of_source_1, ...])
    source = table.source(np.arange(n_eval, table.size))   # a Trainer source (`loader`)
    windows = table.windows(rows, seq_len)                 # the target's packed windows

`samples_of_source_s` are this process's `TokenizedSample`s of source s (its block of that
source's rows, in order). The one-process order of the samples is source by source, and within a
source process 0's samples, then process 1's, ...: the order of one process reading every row.
Every process knows every sample's length and loss-token count (gathered, a few bytes a row), so
all of them compute the same loader order and bucket lengths. The table holds the tokens once
over the data x fsdp devices ([P·M, W] int32 ids + uint8 loss mask, M rows per process).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dspark_jax import parallel
from dspark_jax.errors import DatasetError
from dspark_jax.train.data import TokenizedSample
from dspark_jax.train.loader import MicroBatch
from dspark_jax.train.steps import data_shards


def per_host_layout(mesh) -> bool:
    """Whether `mesh` gives each process its own contiguous block of batch rows (processes laid
    along data / fsdp), the layout `HostTable` needs; False for one process (nothing to split)."""
    p = jax.process_count()
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    return p > 1 and rows % p == 0 and data_shards(mesh, rows) == p


def gather_hosts(x: np.ndarray) -> np.ndarray:
    """[P, ...]: `x` of every process (same shape everywhere); collective."""
    if jax.process_count() == 1:
        return x[None]
    return np.asarray(multihost_utils.process_allgather(x))


class HostTable:
    """The tokenized samples of every process as one global table (see the module docstring).

    `size` samples in the one-process order; sample i is table row `row[i]`, `lengths[i]`
    tokens, `num_loss_tokens[i]` supervised ones. `local` maps a table row this process holds to
    its `TokenizedSample`."""

    def __init__(self, mesh, ids, mask, row, lengths, num_loss_tokens, local):
        self.mesh, self.ids, self.mask = mesh, ids, mask  # [P·M, W] global arrays
        self.row, self.lengths, self.num_loss_tokens = row, lengths, num_loss_tokens  # [N]
        self.local = local
        self.size = len(row)
        self.width = ids.shape[1]

    @classmethod
    def of(cls, mesh, sources: Sequence[Sequence[TokenizedSample]]) -> HostTable:
        """Every process calls this with its own samples of each source (same number of sources
        everywhere); collective."""
        p, k = jax.process_count(), jax.process_index()
        mine = [s for src in sources for s in src]
        counts = gather_hosts(np.asarray([len(src) for src in sources], np.int64))  # [P, S]
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        step = max(shards // p, 1)  # each process's rows split over its data x fsdp devices
        m = max(-(-int(counts.sum(1).max()) // step) * step, step)
        lens = np.zeros(m, np.int64)
        lens[: len(mine)] = [len(s) for s in mine]
        nloss = np.zeros(m, np.int64)
        nloss[: len(mine)] = [s.num_loss_tokens for s in mine]
        all_lens, all_nloss = gather_hosts(lens), gather_hosts(nloss)  # [P, M]
        width = max(int(all_lens.max()), 1)
        ids = np.zeros((m, width), np.int32)
        mask = np.zeros((m, width), np.uint8)
        for j, s in enumerate(mine):
            ids[j, : len(s)] = s.input_ids
            mask[j, : len(s)] = s.loss_mask
        row = []
        starts = np.cumsum(counts, axis=1) - counts  # [P, S]: first local row of each source
        for s in range(counts.shape[1]):
            for q in range(p):
                row += range(q * m + starts[q, s], q * m + starts[q, s] + counts[q, s])
        row = np.asarray(row, np.int64)
        return cls(
            mesh,
            parallel.global_batch(mesh, ids, batch=p * m),
            parallel.global_batch(mesh, mask, batch=p * m),
            row,
            all_lens.reshape(-1)[row],
            all_nloss.reshape(-1)[row],
            {k * m + j: s for j, s in enumerate(mine)},
        )

    def source(self, samples: np.ndarray) -> HostSource:
        """A `loader` source over table samples `samples` (indices into the one-process order)."""
        return HostSource(self, np.asarray(samples, np.int64))

    def windows(self, samples: np.ndarray, seq_len: int) -> PackedWindows:
        """The target's training windows (`lm.pack_windows`) of table samples `samples`."""
        return PackedWindows(self, np.asarray(samples, np.int64), seq_len)


class HostSource:
    """A training source (`loader.SampleSource`) over rows of a `HostTable`. Its lengths cover
    every process's rows, so every process plans the same batches; `get` reads only rows this
    process holds, and the Trainer's batches come from `device_batch` (gathered on the mesh).
    The loader keeps the one-process order for it (`one_process_order`)."""

    one_process_order = True

    def __init__(self, table: HostTable, samples: np.ndarray):
        self.table, self.samples = table, samples
        self.lengths = table.lengths[samples]
        self.num_loss_tokens = table.num_loss_tokens[samples]

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, i: int) -> dict[str, np.ndarray]:
        r = int(self.table.row[self.samples[i]])
        if r not in self.table.local:
            raise DatasetError(
                f"row {i} is held by another process; read batches with device_batch (per-host "
                "data: each process holds only its own rows)"
            )
        s = self.table.local[r]
        return {"input_ids": s.input_ids, "loss_mask": s.loss_mask}

    def prototype(self) -> dict[str, np.ndarray]:
        """The fields of a row (dtypes and trailing shapes), without reading one."""
        return {"input_ids": np.zeros(0, np.int32), "loss_mask": np.zeros(0, np.uint8)}

    def device_batch(self, mesh, mb: MicroBatch, pad_id: int, after=None) -> dict[str, jax.Array]:
        """The global micro-batch `mb` as `loader.load_rows` pads it (filler rows: all padding),
        gathered from the table on the mesh; placed by `parallel.batch_sharding`. The gather runs
        after the program that wrote `after` (`in_order`)."""
        b, length = mb.shape
        valid = mb.indices >= 0
        idx = self.samples[np.where(valid, mb.indices, 0)]
        rows = np.where(valid, self.table.row[idx], -1).astype(np.int32)
        lens = np.where(valid, self.table.lengths[idx], 0).astype(np.int32)
        sharding = parallel.batch_sharding(mesh, (b, length))
        fn = _rows_program(length, self.table.ids.sharding, sharding)
        ids, loss, attn = fn(self.table.ids, self.table.mask, rows, lens, np.int32(pad_id),
                             in_order(after))  # fmt: skip
        return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn}


class HostShards:
    """A training source whose samples every process holds a block of, read from its own source
    `local` (e.g. its own `features.FeatureCacheReader`: offline features computed per host):
    process k holds global samples [offset_k, offset_k + len(local_k)), processes in order.
    Lengths and loss-token counts cover every process's samples (gathered), so every process
    plans the same steps; the loader draws process k's rows of every batch from its own block
    (`process_rows`) and `eval_batches` fills each batch's rows of process k from its block, so
    no process reads another's rows. Unlike `HostSource`, the batches are not the one-process
    run's: each holds B/P rows of every process's block, as in any per-process data stream.
    Collective (every process builds one, with its own `local`)."""

    def __init__(self, local):
        counts = gather_hosts(np.asarray([len(local)], np.int64))[:, 0]  # [P]
        if counts.min() == 0:
            raise DatasetError(
                f"process {int(np.argmin(counts))} holds no sample of this source; use fewer "
                "processes or more data"
            )
        m = int(counts.max())
        lens, nloss = np.zeros(m, np.int64), np.zeros(m, np.int64)
        lens[: len(local)], nloss[: len(local)] = local.lengths, local.num_loss_tokens
        all_lens, all_nloss = gather_hosts(lens), gather_hosts(nloss)  # [P, M]
        self.local = local
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.process_rows = [
            np.arange(self.offsets[q], self.offsets[q + 1]) for q in range(len(counts))
        ]
        self.lengths = np.concatenate([all_lens[q, :c] for q, c in enumerate(counts)])
        self.num_loss_tokens = np.concatenate([all_nloss[q, :c] for q, c in enumerate(counts)])
        self._lo = int(self.offsets[jax.process_index()])

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, i: int) -> dict[str, np.ndarray]:
        j = int(i) - self._lo
        if not 0 <= j < len(self.local):
            raise DatasetError(
                f"row {i} is held by another process (per-host data: each process reads only its "
                "own block)"
            )
        return self.local.get(j)

    def prototype(self) -> dict[str, np.ndarray]:
        """The fields of a row (dtypes and trailing shapes), from this process's first row."""
        return {k: np.asarray(v)[:0] for k, v in self.local.get(0).items()}

    def check_target(self, target_cfg) -> None:
        self.local.check_target(target_cfg)


@functools.cache
def _rows_program(length: int, table_sharding, sharding):
    """rows [B] of the table, right-padded (or cut) to `length` columns; -1 = a filler row."""

    def rows_BxL(ids_NxW, mask_NxW, rows_B, lens_B, pad_id, after):
        w = ids_NxW.shape[1]
        r = jnp.broadcast_to(jnp.maximum(rows_B, 0)[:, None], (rows_B.shape[0], length))
        cols = jnp.broadcast_to(jnp.minimum(jnp.arange(length), w - 1), r.shape)
        real_BxL = jnp.arange(length)[None, :] < lens_B[:, None]
        ids, loss = _elements(table_sharding, (ids_NxW, mask_NxW), r, cols)
        ids, loss = jnp.where(real_BxL, ids, pad_id), jnp.where(real_BxL, loss, 0)
        return ids.astype(jnp.int32), loss.astype(jnp.uint8), real_BxL.astype(jnp.uint8)

    return jax.jit(rows_BxL, out_shardings=(sharding, sharding, sharding), keep_unused=True)


class PackedWindows:
    """`lm.pack_windows` of table samples `samples` (their tokens concatenated in that order,
    cut into [n, seq_len + 1] windows), gathered on the mesh a batch at a time (`take`)."""

    def __init__(self, table: HostTable, samples: np.ndarray, seq_len: int):
        self.table, self.samples, self.seq_len = table, samples, seq_len
        if table.ids.size >= 2**31:  # the gather's flat indices are int32
            raise DatasetError(
                f"a token table of {table.ids.shape} is too large for per-host windows (int32 "
                "indices); lower target.render_windows or the number of conversations"
            )
        self.ends = np.cumsum(table.lengths[samples])  # [n] end of each sample in the stream
        total = int(self.ends[-1]) if len(samples) else 0
        self.num = (total - 1) // seq_len
        if self.num < 1:
            raise ValueError(
                f"not enough text to train the target: {total} tokens < seq_len + 1 = {seq_len + 1}"
            )

    @property
    def mesh(self):
        return self.table.mesh

    def __len__(self) -> int:
        return self.num

    def take(self, windows: np.ndarray, after=None) -> jax.Array:
        """Windows `windows` [B] as a global [B, seq_len + 1] int32 array (batch-sharded),
        gathered after the program that wrote `after` (`in_order`)."""
        pos = np.asarray(windows, np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        s = np.searchsorted(self.ends, pos, side="right")  # the sample of each stream position
        lens = self.table.lengths[self.samples]
        offset = pos - (self.ends[s] - lens[s])
        rows = self.table.row[self.samples[s]].astype(np.int32)  # [B, seq_len + 1] table rows
        sharding = parallel.batch_sharding(self.mesh, rows.shape)
        fn = _windows_program(self.table.ids.sharding, sharding)
        return fn(self.table.ids, rows, offset.astype(np.int32), in_order(after))


@functools.cache
def _windows_program(table_sharding, sharding):
    def windows(ids_NxW, rows, cols, after):
        return _elements(table_sharding, (ids_NxW,), rows, cols)[0]

    return jax.jit(windows, out_shardings=sharding, keep_unused=True)


def _elements(table_sharding, tables, rows, cols) -> tuple:
    """`t[rows, cols]` of each table `t` in `tables` (tables of one shape whose rows are sharded
    over the mesh as `table_sharding`; `rows`, `cols` of one shape): each device reads the rows
    it holds (0 elsewhere) and one sum over the row-sharding axes assembles the values. One
    all-reduce and no collective-permute: XLA:CPU's own lowering of this gather (two permutes
    and an all-reduce) hung now and then between two processes (a permute waiting on a device
    already in the next all-reduce)."""
    d0 = table_sharding.spec[0] if len(table_sharding.spec) else None
    axes = () if d0 is None else (d0,) if isinstance(d0, str) else tuple(d0)
    if not axes:
        return tuple(t[rows, cols] for t in tables)

    def local(ts, r, c):
        n = ts[0].shape[0]
        lo = jax.lax.axis_index(axes) * n
        mine = (r >= lo) & (r < lo + n)
        i = jnp.clip(r - lo, 0, n - 1)
        vs = tuple(jnp.where(mine, t[i, c], 0).astype(jnp.int32) for t in ts)
        return tuple(v.astype(t.dtype) for v, t in zip(jax.lax.psum(vs, axes), ts))

    spec = jax.sharding.PartitionSpec
    return jax.shard_map(local, mesh=table_sharding.mesh, in_specs=(spec(axes), spec(), spec()),
                         out_specs=spec())(tuple(tables), rows, cols)  # fmt: skip


def in_order(after) -> jax.Array | np.ndarray:
    """An input that makes a gather wait for the program that wrote `after` (any pytree of
    arrays, e.g. the last step's loss or gradients; None: nothing to wait for).

    A gather from the table and a training step are both programs with cross-process
    collectives, and XLA:CPU starts a program on a device as soon as its inputs are ready: the
    next batch's gather (its inputs ready at once) could otherwise start before the running step
    on one device and after it on another, each then waiting in a collective the other has not
    reached. Passed as an unused argument (`keep_unused`), the step's output orders the gather
    after the step on every device."""
    leaves = jax.tree.leaves(after)
    return leaves[0] if leaves else np.zeros((), np.int32)


__all__ = [
    "HostShards",
    "gather_hosts",
    "HostSource",
    "HostTable",
    "PackedWindows",
    "in_order",
    "per_host_layout",
]
