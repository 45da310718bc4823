"""Byte-level BPE tokenizer: special tokens, round trip, HF format, chat template, caching."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_jax.errors import CheckpointError
from dspark_jax.models.hf import load_tokenizer
from dspark_jax.templates import CHAT_TEMPLATE
from dspark_jax.testing import tiny_tokenizer
from dspark_jax.train.tokenizer import (
    SPECIAL_TOKENS,
    special_token_ids,
    train_tokenizer,
)

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n    pass\n",
    "The answer is 42. Step 1: 6 * 7 = 42.\n",
    "Explain the assert statement in Python.  Assertions are a convenient way.\n",
] * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")


def test_special_tokens_are_first_ids_inside_vocab(tok):
    assert len(tok) == 512
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == [0, 1, 2, 3]
    sp = special_token_ids(tok)
    assert sp["eos_id"] == 2 and sp["eos_ids"] == [2, 0]
    assert sp["pad_id"] == 0 and sp["mask_id"] == 3 and sp["im_start_id"] == 1
    assert 0 <= sp["mask_id"] < len(tok)
    assert tok.eos_token == "<|im_end|>"
    # special tokens are atomic in text
    assert tok("a<|mask|>b", add_special_tokens=False)["input_ids"][1] == 3


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_any_text_round_trips(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_round_trip_code_and_unicode(tok):
    for text in ["    x = {'a': [1, 2]}\n\t\ty\r\n", "naïve café — 東京 🙂", "", "\n\n\n   "]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # digits are split one by one (arithmetic)
    ids = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5


def test_autotokenizer_loads_offline_with_chat_template(tok, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.getbasetemp() / "tok_cache"
    (d,) = [p for p in path.iterdir() if p.name.startswith("tiny_tokenizer")]
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    auto = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    text = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    # enable_thinking is accepted and ignored; no generation prompt without the flag
    text2 = auto.apply_chat_template(msgs[:2], tokenize=False, enable_thinking=True)
    assert text2 == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert auto(text2, add_special_tokens=False)["input_ids"][0] == 1
    assert auto.decode(auto(text, add_special_tokens=False)["input_ids"]) == text


def test_train_caches_and_retrains_on_change(tmp_path):
    out = tmp_path / "tok"
    t1 = train_tokenizer(TEXTS, out, 300, min_frequency=1)
    meta = out / "dspark_tokenizer.json"
    stamp = meta.stat().st_mtime_ns
    t2 = train_tokenizer(TEXTS, out, 300, min_frequency=1)
    assert meta.stat().st_mtime_ns == stamp  # loaded, not retrained
    assert t1.get_vocab() == t2.get_vocab()
    train_tokenizer(TEXTS, out, 280, min_frequency=1)
    assert meta.stat().st_mtime_ns != stamp
    assert len(load_tokenizer(out)) == 280
    assert not [p for p in os.listdir(out) if p.startswith(".tmp")]


def test_training_is_deterministic_and_reads_files(tmp_path):
    text_file = tmp_path / "text.txt"
    text_file.write_text("".join(TEXTS), encoding="utf-8")
    train_tokenizer(text_file, tmp_path / "a", 300, min_frequency=1)
    train_tokenizer(str(text_file), tmp_path / "b", 300, min_frequency=1)
    a = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.*train_tokenizer"):
        load_tokenizer(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="corpus_text"):
        train_tokenizer(tmp_path / "missing.txt", tmp_path / "t", 300)
    with pytest.raises(ValueError, match="vocab_size must be ≥ 260"):
        train_tokenizer(TEXTS, tmp_path / "t", 100)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", "  "], tmp_path / "t", 300)
