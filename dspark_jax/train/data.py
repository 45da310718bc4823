"""Prompt and conversation data: read, validate, render, mask, batch and write (REFERENCE §1).

Formats (one JSON object per line; blank lines are ignored):

* prompt files (DeepSpec ``eval_datasets``): ``{"turns": ["user turn 1", "user turn 2", ...]}``;
* conversation files: ``{"id": ..., "conversations": [{"role": ..., "content": ...}, ...]}``
  (``{"from": ..., "value": ...}`` messages, as in ShareGPT-style sources, are accepted too).

Roles are mapped as in REFERENCE §1.1: human/user → user, gpt/chatgpt/bing/bard/assistant →
assistant, any other role (e.g. system) is dropped; a kept conversation starts with a user turn
and has only non-empty contents. Rows that break these rules are *dropped* and counted in
`ReadStats`; a file that is structurally wrong (not JSON, missing field, wrong type, empty) raises
`DataError` naming the file and line, before anything is returned.

Rendering uses the tokenizer's own chat template; the assistant-only loss mask is computed on the
rendered text exactly as REFERENCE §1.3 step 5 (regex from after the assistant header to and
including the end-of-turn string; character offsets → token offsets by re-tokenizing prefixes).

Every writer here is atomic: the data goes to a temporary file in the same directory, which is
fsynced and `os.replace`d over the destination, so a reader never sees a half-written file.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dspark_jax.buckets import TRAIN_SEQ_BUCKETS, bucket_up
from dspark_jax.errors import DataError
from dspark_jax.io import atomic_write

# Role names as they appear in sources → our two roles. Anything else is dropped (REFERENCE §1.1).
ROLE_MAP: dict[str, str] = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}

DEFAULT_BUCKETS: tuple[int, ...] = TRAIN_SEQ_BUCKETS
EVAL_PROMPT_SEED = 980406  # REFERENCE §6.1: rows shuffled with random.Random(980406) before capping

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


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line_number, object)` for every non-blank line; 1-based line numbers.

    Raises `DataError` for a missing file, invalid UTF-8 or JSON, a line that is not an object,
    and a file with no rows at all.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "file not found; check the path (prompt/conversation JSONL)")
    n_rows = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, lineno, f"not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    path, lineno, f"not valid JSON ({e.msg}, column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            n_rows += 1
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
    under REFERENCE §1.1. Structural problems (not a list, message not an object, missing or
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
                continue  # REFERENCE §1.1: other roles are dropped
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
    path: str | os.PathLike, *, keep_system: bool = False
) -> tuple[list[Conversation], ReadStats]:
    """Read a conversation JSONL file (see module docstring) into validated `Conversation`s.

    A row without an ``id`` gets its 0-based row index. Conversations with only user turns are
    kept (regeneration input); the encoder later drops those with too few loss tokens.
    """
    stats = ReadStats(source=Path(path).name)
    convs: list[Conversation] = []
    for row_idx, (lineno, obj) in enumerate(iter_jsonl(path)):
        if "conversations" not in obj:
            raise DataError(path, lineno, 'missing field "conversations" (a list of messages)')
        stats.read += 1
        msgs, reason = normalize_messages(
            obj["conversations"], path, lineno, keep_system=keep_system
        )
        if msgs is None:
            stats.drop(reason)
            continue
        convs.append(Conversation(msgs, **_row_meta(obj, row_idx)))
        stats.kept += 1
    return convs, stats


def read_prompts(path: str | os.PathLike) -> tuple[list[Prompt], ReadStats]:
    """Read a prompt JSONL file into `Prompt`s.

    Rows are ``{"turns": [str, ...]}`` (DeepSpec format) or conversation rows, of which only the
    user turns are kept (REFERENCE §1.2: assistant turns are regenerated). Empty turns drop the row.
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
    """The evaluation subset of REFERENCE §6.1: all rows if ≤ cap, else shuffle and take `cap`."""
    rows = list(prompts)
    if cap is None or len(rows) <= cap:
        return rows
    random.Random(seed).shuffle(rows)
    return rows[:cap]


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


def _tfds_examples(tfds: Any, name: str, split: str, data_dir: str | None, download: bool):
    """Examples of a prepared TFDS dataset as numpy dicts, in stored order.

    ArrayRecord datasets are read through `as_data_source` (no TensorFlow needed); TFRecord ones
    through `tfds.load` (needs TensorFlow)."""
    builder = tfds.builder(name, data_dir=data_dir)
    if download:
        builder.download_and_prepare()
    try:
        source = builder.as_data_source(split=split)
    except NotImplementedError:  # a TFRecord dataset: the TensorFlow reader
        ds = tfds.load(name, split=split, data_dir=data_dir, download=False)
        yield from tfds.as_numpy(ds)
        return
    for i in range(len(source)):
        yield source[i]


def read_tfds(
    name: str,
    *,
    split: str = "train",
    kind: Literal["prompts", "conversations", "auto"] = "prompts",
    field: str | None = None,
    data_dir: str | None = None,
    limit: int | None = None,
    download: bool = False,
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
    TensorFlow.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "read_tfds needs TensorFlow Datasets: pip install 'dspark-jax[tfds]' "
            "(or use JSONL prompt/conversation files instead)"
        ) from e
    where = f"tfds:{name}/{split}"
    stats = ReadStats(source=where)
    out: list = []
    examples = _tfds_examples(tfds, name, split, data_dir, download)
    for idx, example in enumerate(examples):
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


# ------------------------------------------------------------------------------------------------
# Writing (atomic)


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


# ------------------------------------------------------------------------------------------------
# Rendering and the loss mask (REFERENCE §1.3)


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    """How conversations become training sequences.

    max_length: right-truncation length in tokens (REFERENCE: 4096; the tiny demo uses 256–512).
    min_loss_tokens: samples with fewer supervised tokens are dropped (REFERENCE: 14).
    enable_thinking: passed to the chat template; ``None`` passes nothing (template default).
    default_system_prompt: inserted when a conversation has no system message (Qwen3 reference:
        "You are a helpful assistant."; our tiny tokenizer: none).
    assistant_header / end_of_turn: the strings that open and close an assistant turn in the
        rendered text; the mask runs from after the header to and including the end of turn.
    assistant_content_prefix: prepended to every assistant content and skipped by the mask
        (Gemma4's empty thought channel); empty for ChatML templates.
    """

    max_length: int = 4096
    min_loss_tokens: int = 14
    enable_thinking: bool | None = False
    default_system_prompt: str | None = None
    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    assistant_content_prefix: str = ""

    def __post_init__(self):
        if self.max_length < 1:
            raise ValueError(f"RenderConfig.max_length must be ≥ 1, got {self.max_length}")
        if self.min_loss_tokens < 0:
            raise ValueError(
                f"RenderConfig.min_loss_tokens must be ≥ 0, got {self.min_loss_tokens}"
            )
        if not self.assistant_header or not self.end_of_turn:
            raise ValueError("RenderConfig.assistant_header and end_of_turn must be non-empty")

    @classmethod
    def qwen3(cls, **overrides: Any) -> RenderConfig:
        """The reference Qwen3 setting: default system prompt, 4096 tokens, ≥ 14 loss tokens."""
        return cls(**{"default_system_prompt": "You are a helpful assistant.", **overrides})

    @classmethod
    def gemma4(cls, **overrides: Any) -> RenderConfig:
        """The reference Gemma4 setting: no system prompt, model turns, empty thought channel."""
        base = {
            "assistant_header": "<|turn>model\n",
            "end_of_turn": "<turn|>\n",
            "assistant_content_prefix": "<|channel>thought\n<channel|>",
        }
        return cls(**{**base, **overrides})


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


def _template_kwargs(enable_thinking: bool | None) -> dict[str, Any]:
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def render_conversation(tokenizer: Any, conversation: Conversation, cfg: RenderConfig) -> str:
    """The full training text: system prompt rule, content prefix, chat template, no gen prompt."""
    messages = conversation.as_dicts()
    if cfg.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": cfg.default_system_prompt})
    if cfg.assistant_content_prefix:
        pre = cfg.assistant_content_prefix
        for m in messages:
            if m["role"] == "assistant" and not m["content"].startswith(pre):
                m["content"] = pre + m["content"]
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=False,
        **_template_kwargs(cfg.enable_thinking),
    )


def assistant_char_spans(text: str, cfg: RenderConfig) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of supervised text: after each assistant header (and the
    optional content prefix) up to and including the next end-of-turn string, or to end of text."""
    pattern = (
        re.escape(cfg.assistant_header)
        + (
            f"(?:{re.escape(cfg.assistant_content_prefix)})?"
            if cfg.assistant_content_prefix
            else ""
        )
        + r"(.*?)(?:"
        + re.escape(cfg.end_of_turn)
        + r"|\Z)"
    )
    return [(m.start(1), m.end()) for m in re.finditer(pattern, text, flags=re.DOTALL)]


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_conversations(
    tokenizer: Any,
    conversations: Iterable[Conversation],
    cfg: RenderConfig = RenderConfig(),
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
    tokenizer: Any, conversation: Conversation, cfg: RenderConfig = RenderConfig()
) -> TokenizedSample | None:
    """One conversation; `None` when it would be dropped (see `encode_conversations`)."""
    samples, _ = encode_conversations(tokenizer, [conversation], cfg)
    return samples[0] if samples else None


# ------------------------------------------------------------------------------------------------
# Prompts for generation / evaluation


def _as_messages(prompt: str | Sequence[Any]) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    out = []
    for m in prompt:
        if isinstance(m, Message):
            out.append({"role": m.role, "content": m.content})
        elif isinstance(m, Mapping) and "role" in m and "content" in m:
            out.append({"role": m["role"], "content": m["content"]})
        else:
            raise TypeError(
                "format_prompt takes a user message string or a list of {role, content} messages; "
                f"got an element of type {type(m).__name__}"
            )
    if not out or out[-1]["role"] != "user":
        raise ValueError("format_prompt: the message list must end with a user message")
    return out


def format_prompt(
    tokenizer: Any, prompt: str | Sequence[Any], *, enable_thinking: bool | None = False
) -> str:
    """Generation prompt text (REFERENCE §6.1): the chat template over one user message (or a
    running message list ending in a user turn, for multi-turn), `add_generation_prompt=True`,
    no system prompt added."""
    return tokenizer.apply_chat_template(
        _as_messages(prompt),
        tokenize=False,
        add_generation_prompt=True,
        **_template_kwargs(enable_thinking),
    )


def encode_prompt(
    tokenizer: Any, prompt: str | Sequence[Any], *, enable_thinking: bool | None = False
) -> np.ndarray:
    """`format_prompt` tokenized without extra special tokens → int32 [T]."""
    text = format_prompt(tokenizer, prompt, enable_thinking=enable_thinking)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


# ------------------------------------------------------------------------------------------------
# Static-shape batching


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedBatch:
    """Right-padded batch: `input_ids` int32 [N, L], `loss_mask` uint8 [N, L] (0 on padding),
    `lengths` int32 [N] (0 for filler rows added to reach a static batch size)."""

    input_ids: np.ndarray  # [N, L] int32
    loss_mask: np.ndarray  # [N, L] uint8
    lengths: np.ndarray  # [N] int32

    @property
    def attention_mask(self) -> np.ndarray:
        """[N, L] bool, True on real tokens."""
        return np.arange(self.input_ids.shape[1])[None, :] < self.lengths[:, None]


def choose_bucket(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket ≥ `length`."""
    b = bucket_up(length, buckets)
    if b is not None:
        return b
    raise ValueError(
        f"sequence of length {length} exceeds the largest bucket {max(buckets)}: add a larger "
        "bucket or lower RenderConfig.max_length"
    )


def pad_to_bucket(
    samples: Sequence[TokenizedSample],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    pad_id: int = 0,
    batch_size: int | None = None,
) -> PaddedBatch:
    """Stack samples right-padded to the smallest bucket that fits the longest one.

    With `batch_size`, filler rows (all `pad_id`, mask 0, length 0) pad N up to it so the batch
    shape is static too.
    """
    if not samples:
        raise ValueError("pad_to_bucket needs at least one sample")
    n = len(samples) if batch_size is None else batch_size
    if n < len(samples):
        raise ValueError(f"{len(samples)} samples do not fit batch_size={batch_size}")
    L = choose_bucket(max(len(s) for s in samples), buckets)
    ids_NxL = np.full((n, L), pad_id, dtype=np.int32)
    mask_NxL = np.zeros((n, L), dtype=np.uint8)
    lengths_N = np.zeros((n,), dtype=np.int32)
    for i, s in enumerate(samples):
        ids_NxL[i, : len(s)] = s.input_ids
        mask_NxL[i, : len(s)] = s.loss_mask
        lengths_N[i] = len(s)
    return PaddedBatch(ids_NxL, mask_NxL, lengths_N)


def make_batches(
    samples: Sequence[TokenizedSample],
    batch_size: int,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    pad_id: int = 0,
    seed: int | None = None,
    drop_remainder: bool = False,
) -> list[PaddedBatch]:
    """Group samples by length bucket and cut each group into `[batch_size, bucket]` batches.

    So there are at most `len(buckets)` distinct shapes. A group's last partial batch is filled
    with empty rows (or dropped with `drop_remainder`). With `seed`, samples are shuffled within
    groups and the batch order is shuffled; without it, input order is kept.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    rng = random.Random(seed)
    groups: dict[int, list[TokenizedSample]] = collections.defaultdict(list)
    for s in samples:
        groups[choose_bucket(len(s), buckets)].append(s)
    batches: list[PaddedBatch] = []
    for L in sorted(groups):
        group = groups[L]
        if seed is not None:
            rng.shuffle(group)
        for lo in range(0, len(group), batch_size):
            part = group[lo : lo + batch_size]
            if len(part) < batch_size and drop_remainder:
                continue
            batches.append(pad_to_bucket(part, (L,), pad_id=pad_id, batch_size=batch_size))
    if seed is not None:
        rng.shuffle(batches)
    return batches
