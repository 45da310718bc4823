"""Prompt and conversation records: read, validate and write them (docs/METHOD.md §1).

Formats (one JSON object per line; blank lines are ignored):

* prompt files (DeepSpec ``eval_datasets``): ``{"turns": ["user turn 1", "user turn 2", ...]}``;
* conversation files: ``{"id": ..., "conversations": [{"role": ..., "content": ...}, ...]}``
  (``{"from": ..., "value": ...}`` messages, as in ShareGPT-style sources, are accepted too).

Roles are mapped as in docs/METHOD.md §1.1: human/user → user, gpt/chatgpt/bing/bard/assistant →
assistant, any other role (e.g. system) is dropped; a kept conversation starts with a user turn
and has only non-empty contents. Rows that break these rules are *dropped* and counted in
`ReadStats`; a file that is structurally wrong (not JSON, missing field, wrong type, empty) raises
`DataError` naming the file and line, before anything is returned.

Every writer here is atomic (dspark_jax/io.py). The rest of the data path: dspark_jax/templates.py
(chat template, supervised spans, prompts), data_packing.py (static-shape batches), data_tfds.py (TFDS).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import random
from collections.abc import Collection, Container, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.errors import DataError
from dspark_jax.io import atomic_write
from dspark_jax.storage import as_path
from dspark_jax.templates import RenderConfig, assistant_char_spans, render_conversation

# Role names in sources → our two roles. Anything else is dropped (docs/METHOD.md §1.1).
ROLE_MAP: dict[str, str] = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}

# docs/METHOD.md §6.1: rows shuffled with random.Random(980406) before capping
EVAL_PROMPT_SEED = 980406

Id = int | str | None


# ------------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # "user" | "assistant" | "system"
    content: str


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A validated conversation: starts with a user turn, roles user/assistant, non-empty text."""

    messages: tuple[Message, ...]
    id: Id = None
    domain: str | None = None
    source: str | None = None

    @classmethod
    def from_pairs(cls, *pairs: tuple[str, str], **meta: Any) -> Conversation:
        """`Conversation.from_pairs(("user", "hi"), ("assistant", "hello"), id=3)`."""
        return cls(tuple(Message(r, c) for r, c in pairs), **meta)

    def as_dicts(self) -> list[dict[str, str]]:
        """Messages as the `[{"role", "content"}, ...]` list chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def user_turns(self) -> tuple[str, ...]:
        return tuple(m.content for m in self.messages if m.role == "user")

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if self.id is not None:
            row["id"] = self.id
        row["conversations"] = self.as_dicts()
        row.update(_meta_json(self))
        return row


@dataclasses.dataclass(frozen=True)
class Prompt:
    """User turns of one request; a multi-turn prompt is answered turn by turn."""

    turns: tuple[str, ...]
    id: Id = None
    domain: str | None = None
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if self.id is not None:
            row["id"] = self.id
        row["turns"] = list(self.turns)
        row.update(_meta_json(self))
        return row


def _meta_json(rec: Conversation | Prompt) -> dict[str, Any]:
    return {k: v for k, v in (("domain", rec.domain), ("source", rec.source)) if v is not None}


@dataclasses.dataclass
class ReadStats:
    """Counts of one read or encode pass: rows read, kept, and dropped per reason."""

    source: str
    read: int = 0
    kept: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def merge(self, other: ReadStats, source: str | None = None) -> ReadStats:
        """A new `ReadStats` with both counts added (for reading several files)."""
        return ReadStats(
            source=source or f"{self.source} + {other.source}",
            read=self.read + other.read,
            kept=self.kept + other.kept,
            dropped=self.dropped + other.dropped,
        )

    def summary(self) -> str:
        """One line, e.g. ``a.jsonl: read 10, kept 8, dropped 2 (2 empty content)``."""
        text = f"{self.source}: read {self.read}, kept {self.kept}, dropped {self.num_dropped}"
        if self.dropped:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.dropped.items()))
            text += f" ({why})"
        return text


# ------------------------------------------------------------------------------------------------
# Reading


def process_block(n: int, index: int, count: int) -> range:
    """Rows [index·n/count, (index+1)·n/count) of `n`: process `index`'s contiguous share of `n`
    rows among `count` processes. The blocks of processes 0, 1, ... in turn are `range(n)`, so
    every row is read by exactly one process and their concatenation is the one-process order."""
    if not 0 <= index < count:
        raise ValueError(f"process index {index} must be in 0 .. {count - 1}")
    return range(index * n // count, (index + 1) * n // count)


def count_jsonl_rows(path: str | os.PathLike) -> int:
    """Non-blank lines of `path` (rows of `iter_jsonl`), counted without parsing them."""
    with as_path(path).open("rb") as f:
        return sum(1 for raw in f if raw.strip())


def iter_jsonl(
    path: str | os.PathLike, rows: Container[int] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line_number, object)` for every non-blank line (only those whose 0-based row
    index is in `rows`, when given: the others are not parsed); 1-based line numbers.

    Raises `DataError` for a missing file, invalid UTF-8 or JSON, a line that is not an object,
    and a file with no rows at all.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "file not found; check the path (prompt/conversation JSONL)")
    n_rows = 0
    with as_path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, lineno, f"not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            n_rows += 1
            if rows is not None and n_rows - 1 not in rows:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    path, lineno, f"not valid JSON ({e.msg}, column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
    if n_rows == 0:
        raise DataError(path, None, "file is empty: expected one JSON object per line")


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def normalize_messages(
    messages: Any, path: str | os.PathLike, line: int | None, *, keep_system: bool = False
) -> tuple[tuple[Message, ...] | None, str | None]:
    """Validate and role-map one raw message list.

    Returns `(messages, None)` when the conversation is kept or `(None, reason)` when it is dropped
    under docs/METHOD.md §1.1. Structural problems (not a list, message not an object, missing or
    non-string role/content) raise `DataError`. With `keep_system`, a leading system message is
    kept (the renderer then uses it instead of any default system prompt).
    """
    if not isinstance(messages, list):
        raise DataError(path, line, f'"conversations" must be a list, got {_type_name(messages)}')
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DataError(path, line, f"message {i} must be an object, got {_type_name(msg)}")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if role is None or ("content" not in msg and "value" not in msg):
            raise DataError(
                path, line, f'message {i} needs "role" and "content" (or "from" and "value")'
            )
        if not isinstance(role, str):
            raise DataError(path, line, f"message {i}: role must be a string")
        if not isinstance(content, str):
            raise DataError(
                path, line, f"message {i}: content must be a string, got {_type_name(content)}"
            )
        mapped = ROLE_MAP.get(role.lower())
        if mapped is None:
            if keep_system and role.lower() == "system" and not out:
                mapped = "system"
            else:
                continue  # docs/METHOD.md §1.1: other roles are dropped
        out.append(Message(mapped, content))
    body = out[1:] if out and out[0].role == "system" else out
    if not body:
        return None, "no user or assistant turns"
    if body[0].role != "user":
        return None, "does not start with a user turn"
    if any(not m.content.strip() for m in out):
        return None, "empty content"
    return tuple(out), None


def _row_meta(obj: Mapping[str, Any], default_id: Id) -> dict[str, Any]:
    meta = {"id": obj.get("id", default_id)}
    for key in ("domain", "source"):
        if isinstance(obj.get(key), str):
            meta[key] = obj[key]
    return meta


def read_conversations(
    path: str | os.PathLike,
    *,
    keep_system: bool = False,
    shard: tuple[int, int] | None = None,
    rows: range | None = None,
) -> tuple[list[Conversation], ReadStats]:
    """Read a conversation JSONL file (see module docstring) into validated `Conversation`s.

    A row without an ``id`` gets its 0-based row index. Conversations with only user turns are
    kept (regeneration input); the encoder later drops those with too few loss tokens.
    `shard=(k, P)` reads (parses, validates) only process k's block of rows (`process_block`);
    `rows` (a range of 0-based row indices) reads only those.
    """
    if shard is not None and Path(path).is_file():
        rows = process_block(count_jsonl_rows(path), *shard)
    got, stats = read_conversation_rows(path, rows, keep_system=keep_system)
    return [c for _, c in got], stats


def read_conversation_rows(
    path: str | os.PathLike, rows: Collection[int] | None = None, *, keep_system: bool = False
) -> tuple[list[tuple[int, Conversation]], ReadStats]:
    """(0-based row index, conversation) of the valid rows among `rows` (any collection of row
    indices below the file's row count; None: every row), in file order; only those rows are
    parsed."""
    stats = ReadStats(source=Path(path).name)
    out: list[tuple[int, Conversation]] = []
    if rows is None:
        indices: Iterable[int] = itertools.count()
    else:
        indices = rows if isinstance(rows, range) else sorted(rows)
        rows = rows if isinstance(rows, range) else frozenset(indices)
    for row_idx, (lineno, obj) in zip(indices, iter_jsonl(path, rows)):
        if "conversations" not in obj:
            raise DataError(path, lineno, 'missing field "conversations" (a list of messages)')
        stats.read += 1
        msgs, reason = normalize_messages(
            obj["conversations"], path, lineno, keep_system=keep_system
        )
        if msgs is None:
            stats.drop(reason)
            continue
        out.append((row_idx, Conversation(msgs, **_row_meta(obj, row_idx))))
        stats.kept += 1
    return out, stats


def read_conversation_block(
    paths: Sequence[str | os.PathLike],
    block: range,
    *,
    keep_system: bool = False,
    counts: Sequence[int] | None = None,
) -> tuple[list[Conversation], ReadStats]:
    """Rows `block` of `paths` read as one file (rows numbered across the files in order):
    only those rows are parsed, e.g. a process's `process_block` of every file's rows.
    `counts`: each file's rows (`count_jsonl_rows`) when the caller has them."""
    convs: list[Conversation] = []
    stats = ReadStats(source=f"rows {block.start}..{block.stop - 1} of {len(paths)} file(s)")
    counts = [count_jsonl_rows(p) for p in paths] if counts is None else counts
    lo = 0
    for p, n in zip(paths, counts):
        mine = range(max(block.start - lo, 0), min(block.stop - lo, n))
        if mine:
            got, st = read_conversations(p, keep_system=keep_system, rows=mine)
            convs += got
            stats = stats.merge(st, stats.source)
        lo += n
    return convs, stats


def read_prompts(path: str | os.PathLike) -> tuple[list[Prompt], ReadStats]:
    """Read a prompt JSONL file into `Prompt`s.

    Rows are ``{"turns": [str, ...]}`` (DeepSpec format) or conversation rows, of which only the
    user turns are kept (docs/METHOD.md §1.2: assistant turns are regenerated). Empty turns drop
    the row.
    """
    stats = ReadStats(source=Path(path).name)
    prompts: list[Prompt] = []
    for row_idx, (lineno, obj) in enumerate(iter_jsonl(path)):
        if "turns" in obj:
            turns = obj["turns"]
            if not isinstance(turns, list):
                raise DataError(path, lineno, f'"turns" must be a list, got {_type_name(turns)}')
            for i, t in enumerate(turns):
                if not isinstance(t, str):
                    raise DataError(path, lineno, f"turn {i} must be a string, got {_type_name(t)}")
            stats.read += 1
            if not turns:
                stats.drop("no turns")
                continue
            if any(not t.strip() for t in turns):
                stats.drop("empty turn")
                continue
            user_turns = tuple(turns)
        elif "conversations" in obj:
            stats.read += 1
            msgs, reason = normalize_messages(obj["conversations"], path, lineno)
            if msgs is None:
                stats.drop(reason)
                continue
            user_turns = tuple(m.content for m in msgs if m.role == "user")
        else:
            raise DataError(
                path, lineno, 'missing field "turns" (a list of user turns) or "conversations"'
            )
        prompts.append(Prompt(user_turns, **_row_meta(obj, row_idx)))
        stats.kept += 1
    return prompts, stats


def select_prompts(prompts: Sequence[Any], cap: int | None, seed: int = EVAL_PROMPT_SEED) -> list:
    """docs/METHOD.md §6.1's evaluation subset: all rows if ≤ cap, else shuffle and take `cap`."""
    rows = list(prompts)
    if cap is None or len(rows) <= cap:
        return rows
    random.Random(seed).shuffle(rows)
    return rows[:cap]


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedSample:
    """One training sequence: `input_ids` int32 [L], `loss_mask` uint8 [L] (1 = supervised)."""

    input_ids: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] uint8
    id: Id = None
    domain: str | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


# ------------------------------------------------------------------------------------------------
# Writing (atomic)


DEFAULT_RENDER = RenderConfig()


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_conversations(
    tokenizer: Any,
    conversations: Iterable[Conversation],
    cfg: RenderConfig = DEFAULT_RENDER,
    *,
    source: str = "conversations",
    chunk_size: int = 256,
) -> tuple[list[TokenizedSample], ReadStats]:
    """Render, tokenize, truncate and mask conversations; drop those under `min_loss_tokens`.

    The mask marks tokens `[len(tok(text[:s])), len(tok(text[:e])))` for every assistant char
    span `[s, e)` (prefix token counts capped at `max_length`, clipped to the sequence), so it
    covers assistant content plus the end-of-turn token(s) and nothing of system/user/headers.
    A sample with no supervised token is always dropped. Tokenization never adds special tokens
    (the template already wrote them).
    """
    stats = ReadStats(source=source)
    samples: list[TokenizedSample] = []
    convs = list(conversations)
    for lo in range(0, len(convs), chunk_size):
        chunk = convs[lo : lo + chunk_size]
        texts = [render_conversation(tokenizer, c, cfg) for c in chunk]
        spans = [assistant_char_spans(t, cfg) for t in texts]
        prefixes = [t[:pos] for t, sp in zip(texts, spans) for s, e in sp for pos in (s, e)]
        full_ids = _encode_batch(tokenizer, texts)
        prefix_lens = iter(len(p) for p in _encode_batch(tokenizer, prefixes))
        for conv, ids, sp in zip(chunk, full_ids, spans):
            stats.read += 1
            ids_L = np.asarray(ids[: cfg.max_length], dtype=np.int32)  # right truncation
            mask_L = np.zeros(ids_L.shape, dtype=np.uint8)
            for _ in sp:
                start = min(next(prefix_lens), cfg.max_length)
                end = min(next(prefix_lens), cfg.max_length)
                mask_L[start:end] = 1
            n_loss = int(mask_L.sum())
            if n_loss == 0 or n_loss < cfg.min_loss_tokens:
                stats.drop(f"fewer than {max(cfg.min_loss_tokens, 1)} loss tokens")
                continue
            samples.append(TokenizedSample(ids_L, mask_L, id=conv.id, domain=conv.domain))
            stats.kept += 1
    return samples, stats


def encode_conversation(
    tokenizer: Any, conversation: Conversation, cfg: RenderConfig = DEFAULT_RENDER
) -> TokenizedSample | None:
    """One conversation; `None` when it would be dropped (see `encode_conversations`)."""
    samples, _ = encode_conversations(tokenizer, [conversation], cfg)
    return samples[0] if samples else None


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> int:
    """Atomically write one JSON object per line; returns the number of rows written."""
    n = 0
    with atomic_write(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def write_conversations(path: str | os.PathLike, conversations: Iterable[Conversation]) -> int:
    """Atomically write conversation JSONL readable by `read_conversations`."""
    return write_jsonl(path, (c.to_json() for c in conversations))


def write_prompts(path: str | os.PathLike, prompts: Iterable[Prompt]) -> int:
    """Atomically write prompt JSONL (``{"turns": [...]}``) readable by `read_prompts`."""
    return write_jsonl(path, (p.to_json() for p in prompts))
