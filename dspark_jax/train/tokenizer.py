"""Byte-level BPE tokenizer for the embedded demo, saved in Hugging Face format.

`train_tokenizer` trains with `tokenizers` and writes a directory that
`transformers.AutoTokenizer.from_pretrained(dir)` loads offline: ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template, ``eos_token="<|im_end|>"``, pad and mask
tokens) and ``chat_template.jinja``. Ids 0–3 are the special tokens, in this order:

    <|endoftext|>  document end; the pad token; a stop token
    <|im_start|>   opens a chat turn
    <|im_end|>     closes a chat turn; the EOS token; a stop token
    <|mask|>       the drafter's mask token (a real row of the embedding, unlike Qwen3's 151669)

The chat template is Qwen-style ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message and ``<|im_start|>assistant\\n`` as generation prompt. It accepts and ignores
``enable_thinking`` (there is no thinking mode), and adds no default system prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark_jax.io import atomic_write, write_bytes_atomic
from dspark_jax.models.hf import load_tokenizer, quiet_transformers
from dspark_jax.templates import CHAT_TEMPLATE

TOKENIZER_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
META_FILE = "dspark_tokenizer.json"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# Pre-tokenization split (Qwen2/GPT-4 style): letters with one leading non-letter, single
# digits (helps arithmetic), punctuation runs, newlines, and whitespace runs that leave the last
# space to the next word.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """vocab_size is an upper bound: a small corpus may yield fewer merges (use `len(tok)`)."""

    vocab_size: int = 2048
    min_frequency: int = 2

    def __post_init__(self):
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(
                f"vocab_size must be ≥ {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special "
                f"tokens), got {self.vocab_size}"
            )
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency must be ≥ 1, got {self.min_frequency}")


def _read_texts(source: str | os.PathLike | Iterable[str]) -> list[str]:
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer training text {path} not found; pass an existing text file "
                "(e.g. corpus_text.txt from build_corpus) or a list of strings"
            )
        return [path.read_text(encoding="utf-8")]
    texts = list(source)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("train_tokenizer: texts must be strings")
    return texts


def _fingerprint(texts: list[str], cfg: TokenizerConfig) -> dict[str, Any]:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    return {"version": TOKENIZER_VERSION, "config": dataclasses.asdict(cfg), "text": h.hexdigest()}


def read_meta(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / META_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _train(texts: list[str], cfg: TokenizerConfig) -> Any:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _save_hf(tok: Any, out_dir: Path, meta: dict[str, Any]) -> None:
    """Write the HF files into a temp dir, then move them into `out_dir`; the meta file last."""
    hf = quiet_transformers().PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tmp-tokenizer-") as tmp:
        hf.save_pretrained(tmp)
        cfg_path = Path(tmp) / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        # Loadable by transformers 4.x and 5.x alike, template inline as well as in the .jinja.
        config.update(
            tokenizer_class="PreTrainedTokenizerFast",
            chat_template=CHAT_TEMPLATE,
            bos_token=None,
            unk_token=None,
            add_bos_token=False,
            add_eos_token=False,
        )
        cfg_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        for name in sorted(os.listdir(tmp)):
            write_bytes_atomic(out_dir / name, (Path(tmp) / name).read_bytes())
    with atomic_write(out_dir / META_FILE) as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def train_tokenizer(
    texts_or_file: str | os.PathLike | Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 2048,
    *,
    min_frequency: int = 2,
    force: bool = False,
) -> Any:
    """Train a byte-level BPE tokenizer and save it in HF format in `out_dir`; return it loaded.

    `texts_or_file` is a path to a UTF-8 text file or an iterable of strings. When `out_dir`
    already holds a tokenizer trained by this function on the same text with the same settings,
    it is loaded instead of retrained (unless `force`). The result is a
    `transformers.PreTrainedTokenizerFast`; every byte is in the alphabet, so any text
    round-trips through encode/decode.
    """
    cfg = TokenizerConfig(vocab_size=vocab_size, min_frequency=min_frequency)
    texts = _read_texts(texts_or_file)
    if not any(t.strip() for t in texts):
        raise ValueError("train_tokenizer: the training text is empty")
    out = Path(out_dir)
    fingerprint = _fingerprint(texts, cfg)
    meta = read_meta(out)
    if not force and meta is not None and meta.get("fingerprint") == fingerprint:
        return load_tokenizer(out, require_chat_template=True)
    tok = _train(texts, cfg)
    _save_hf(tok, out, {"fingerprint": fingerprint, "vocab_size": tok.get_vocab_size()})
    return load_tokenizer(out, require_chat_template=True)


def special_token_ids(tok: Any) -> dict[str, Any]:
    """Ids the rest of the code needs.

    Returns ``{"eos_id": int, "eos_ids": [int, ...], "pad_id": int, "mask_id": int | None,
    "im_start_id": int | None}``: `eos_ids` are the stop tokens (the EOS token first, then
    ``<|im_end|>``/``<|endoftext|>`` when present); `pad_id` falls back to the EOS id; `mask_id`
    is the tokenizer's mask token or ``<|mask|>``, and ``None`` for tokenizers without one (a
    Qwen3 target's mask id lies beyond its vocabulary and comes from the drafter config).
    """

    vocab = tok.get_vocab()
    tid = vocab.get

    eos_id = tok.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token; set eos_token in tokenizer_config.json")
    eos_ids = [eos_id]
    for t in STOP_TOKENS:
        i = tid(t)
        if i is not None and i not in eos_ids:
            eos_ids.append(i)
    mask_id = getattr(tok, "mask_token_id", None)
    if mask_id is None:
        mask_id = tid(MASK_TOKEN)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id
    return {
        "eos_id": eos_id,
        "eos_ids": eos_ids,
        "pad_id": pad_id,
        "mask_id": mask_id,
        "im_start_id": tid("<|im_start|>"),
    }
