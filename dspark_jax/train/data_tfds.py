"""TensorFlow Datasets as a conversation source (`read_tfds`, `parse_tfds_spec`, and
`tfds_source`: what identifies a dataset's content in a stage key)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dspark_jax.errors import DataError
from dspark_jax.train.data import (
    Conversation,
    Message,
    Prompt,
    ReadStats,
    normalize_messages,
    process_block,
)


def _tfds_text(x: Any) -> Any:
    if isinstance(x, bytes):
        return x.decode("utf-8")
    if isinstance(x, np.ndarray):
        return [_tfds_text(v) for v in x.tolist()] if x.ndim else _tfds_text(x.item())
    if isinstance(x, list | tuple):
        return [_tfds_text(v) for v in x]
    if isinstance(x, dict):
        return {k: _tfds_text(v) for k, v in x.items()}
    return x


def parse_tfds_spec(spec: str) -> tuple[str, str, str | None]:
    """``name[:split[:field]]`` (e.g. ``my_chats:train[:90%]:conversations``) -> (name, split,
    field); split defaults to ``train``, field to None (auto)."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"data.tfds={spec!r}: expected name[:split[:field]], e.g. my_chats:train")
    m = re.fullmatch(r"(.*?)(?::([A-Za-z_][\w./-]*))?", rest)
    split, field = m.group(1), m.group(2)
    return name, split or "train", field or None


def _import_tfds():
    try:
        import tensorflow_datasets as tfds  # optional dependency: pip install 'dspark-jax[tfds]'
    except ImportError as e:
        raise ImportError(
            "reading data.tfds needs TensorFlow Datasets: pip install 'dspark-jax[tfds]' "
            "(or use JSONL prompt/conversation files instead)"
        ) from e
    return tfds


def tfds_source(spec: str, data_dir: str | None = None) -> dict:
    """What identifies the content `spec` ("name[:split[:field]]") reads, for stage keys: the
    name, split and field, the prepared dataset's version, and a hash of its
    `dataset_info.json` (its split sizes, shard lengths and features), so that another dataset,
    split, field, version or a rebuilt dataset changes the key. Where it is stored (`data_dir`)
    is not part of it."""
    name, split, field = parse_tfds_spec(spec)
    builder = _import_tfds().builder(name, data_dir=data_dir)
    info = Path(builder.data_dir) / "dataset_info.json"
    if not info.is_file():
        raise DataError(
            f"tfds:{name}",
            None,
            f"not prepared in {builder.data_dir} — prepare it there first or "
            "set data.tfds_data_dir to where it is",
        )
    digest = hashlib.sha256(info.read_bytes()).hexdigest()[:16]
    return {"name": name, "split": split, "field": field, "version": str(builder.version),
            "info": digest}  # fmt: skip


def count_tfds_examples(name: str, split: str = "train", data_dir: str | None = None) -> int:
    """The examples of a prepared TFDS split (from its metadata: nothing is read)."""
    builder = _import_tfds().builder(name, data_dir=data_dir)
    return int(builder.info.splits[split].num_examples)


def _tfds_examples(
    tfds: Any, name: str, split: str, data_dir: str | None, download: bool, shard, rows=None
) -> Iterator[tuple[int, Any]]:
    """(0-based index in the split, example as numpy dicts) of a prepared TFDS dataset, in
    stored order; with `shard=(k, P)` only process k's contiguous block (`process_block`); with
    `rows` (a collection of indices) only those.

    ArrayRecord datasets are read through `as_data_source` (no TensorFlow needed; only the
    block's or the rows' records are read); TFRecord ones through `tfds.load` of the block's
    split slice (needs TensorFlow; `rows` are picked from the whole split as it streams)."""
    picked = rows
    builder = tfds.builder(name, data_dir=data_dir)
    if download:
        builder.download_and_prepare()
    try:
        source = builder.as_data_source(split=split)
    except NotImplementedError:  # a TFRecord dataset: the TensorFlow reader
        if shard and "[" in split:
            raise ValueError(
                f"split {split!r}: a sliced TFRecord split cannot be read per process — prepare "
                "the dataset as ArrayRecord or name a whole split"
            ) from None
        n = builder.info.splits[split].num_examples
        rows = process_block(n, *shard) if shard else range(n)
        part = f"{split}[{rows.start}:{rows.stop}]" if shard else split
        ds = tfds.load(name, split=part, data_dir=data_dir, download=False)
        wanted = None if picked is None else frozenset(picked)
        for i, ex in zip(rows, tfds.as_numpy(ds)):
            if wanted is None or i in wanted:
                yield i, ex
        return
    if picked is not None:
        rows = sorted(picked)
    else:
        rows = process_block(len(source), *shard) if shard else range(len(source))
    for i in rows:
        yield i, source[i]


def read_tfds(
    name: str,
    *,
    split: str = "train",
    kind: Literal["prompts", "conversations", "auto"] = "prompts",
    field: str | None = None,
    data_dir: str | None = None,
    limit: int | None = None,
    download: bool = False,
    shard: tuple[int, int] | None = None,
    rows: Collection[int] | None = None,
) -> tuple[list[Prompt] | list[Conversation], ReadStats]:
    """Read prompts or conversations from a TensorFlow-Datasets dataset (extra ``[tfds]``).

    `field` names the example feature: for prompts a string (one turn) or a list of strings
    (default ``"turns"``); for conversations a sequence of ``{role, content}`` (or ``{from,
    value}``) messages (default ``"conversations"``), as a list of dicts or a dict of lists.
    `kind="auto"` reads conversations when the examples have that field (or `field` holds
    messages) and otherwise prompts, returned as user-only `Conversation`s (regeneration input).
    Validation, role mapping and drop reasons are those of the JSONL readers; errors name
    ``tfds:<name>/<split>`` and the 1-based example number. `download=False` by default because
    the machines we target are offline: prepare the dataset into `data_dir` first. ArrayRecord
    datasets (the TFDS default for new builds with `file_format="array_record"`) need no
    TensorFlow. `shard=(k, P)` reads only process k's contiguous block of the split's examples
    (`process_block`; ids stay the examples' indices in the whole split); `rows` reads only
    the examples of those indices.
    """
    tfds = _import_tfds()
    where = f"tfds:{name}/{split}"
    stats = ReadStats(source=where)
    out: list = []
    examples = _tfds_examples(tfds, name, split, data_dir, download, shard, rows)
    for idx, example in examples:
        if limit is not None and idx >= limit:
            break
        k, f = kind, field
        if k == "auto":
            f = f or ("conversations" if "conversations" in example else "turns")
            v = _tfds_text(example.get(f))
            k = "conversations" if isinstance(v, dict) or _is_messages(v) else "prompts"
        f = f or ("turns" if k == "prompts" else "conversations")
        if f not in example:
            raise DataError(where, idx + 1, f"example has no feature {f!r}; pass field=...")
        value = _tfds_text(example[f])
        stats.read += 1
        if k == "prompts":
            turns = [value] if isinstance(value, str) else value
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise DataError(where, idx + 1, f"{f!r} must be a string or list of strings")
            if not turns or any(not t.strip() for t in turns):
                stats.drop("empty turn")
                continue
            if kind == "auto":
                out.append(Conversation(tuple(Message("user", t) for t in turns), id=idx))
            else:
                out.append(Prompt(tuple(turns), id=idx))
        else:
            if isinstance(value, dict):  # dict of parallel lists → list of dicts
                keys = list(value)
                value = [dict(zip(keys, vals)) for vals in zip(*(value[k] for k in keys))]
            msgs, reason = normalize_messages(value, where, idx + 1)
            if msgs is None:
                stats.drop(reason)
                continue
            out.append(Conversation(msgs, id=idx))
        stats.kept += 1
    return out, stats


def _is_messages(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) for m in v)
