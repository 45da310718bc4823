"""Data layer: readers and their errors, role mapping, loss mask (docs/METHOD.md §1.3), batching,
prompt formatting and atomic writing."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_jax.errors import DataError
from dspark_jax.io import atomic_write
from dspark_jax.templates import RenderConfig, assistant_char_spans, encode_prompt, format_prompt
from dspark_jax.testing import gemma4_style_tokenizer, tiny_tokenizer
from dspark_jax.train.data import (
    Conversation,
    Prompt,
    ReadStats,
    TokenizedSample,
    encode_conversation,
    encode_conversations,
    read_conversations,
    read_prompts,
    select_prompts,
    write_conversations,
    write_jsonl,
    write_prompts,
)
from dspark_jax.train.data_packing import make_batches, pad_to_bucket
from dspark_jax.train.data_tfds import read_tfds

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
EOT = "<|im_end|>\n"
CFG = RenderConfig(max_length=512, min_loss_tokens=1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def masked_runs(tok, sample):
    """Decoded text of every maximal run of mask == 1, and of the unmasked remainder."""
    ids, mask = sample.input_ids, sample.loss_mask
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs, tok.decode(ids[mask == 0].tolist())


# ------------------------------------------------------------------------------------------------
# Reading


@pytest.mark.skipif(not PROMPTS_DIR.is_dir(), reason="../shared/data/prompts not present")
def test_reads_real_prompt_files():
    expected = {"gsm8k.jsonl": 1319, "humaneval.jsonl": 164, "mt-bench.jsonl": 80}
    for name, n in expected.items():
        prompts, stats = read_prompts(PROMPTS_DIR / name)
        assert len(prompts) == n and stats.read == n and stats.kept == n and not stats.dropped
        assert all(isinstance(t, str) and t for p in prompts for t in p.turns)
        assert prompts[0].id == 0 and prompts[-1].id == n - 1
    mt, _ = read_prompts(PROMPTS_DIR / "mt-bench.jsonl")
    assert all(len(p.turns) == 2 for p in mt)
    gsm, _ = read_prompts(PROMPTS_DIR / "gsm8k.jsonl")
    assert gsm[0].turns[0].startswith("Janet")
    assert len(select_prompts(gsm, 500)) == 500
    assert select_prompts(gsm, 500) == select_prompts(gsm, 500)
    assert len(select_prompts(mt, 500)) == 80


BAD_FILES = [
    ("prompts", ['{"turns": ["a"]}', "{not json", '{"turns": ["b"]}'], 2, "not valid JSON"),
    ("prompts", ['{"turns": ["a"]}', '{"text": "b"}'], 2, 'missing field "turns"'),
    ("prompts", ["", "  "], None, "file is empty"),
    ("prompts", ['{"turns": "a"}'], 1, '"turns" must be a list'),
    ("prompts", ['{"turns": ["a", 3]}'], 1, "turn 1 must be a string"),
    ("prompts", ['["a"]'], 1, "expected a JSON object"),
    ("conversations", ['{"turns": ["a"]}'], 1, 'missing field "conversations"'),
    ("conversations", ['{"conversations": {"role": "user"}}'], 1, "must be a list"),
    ("conversations", ['{"conversations": ["hi"]}'], 1, "message 0 must be an object"),
    ("conversations", ['{"conversations": [{"role": "user"}]}'], 1, 'needs "role" and "content"'),
    (
        "conversations",
        ["", '{"conversations": [{"role": "user", "content": null}]}'],
        2,
        "content must be a string, got null",
    ),
    ("conversations", ['{"conversations": [{"role": 1, "content": "x"}]}'], 1, "role must be"),
]


@pytest.mark.parametrize("kind, lines, line, message", BAD_FILES)
def test_bad_files_name_file_and_line(tmp_path, kind, lines, line, message):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    reader = read_prompts if kind == "prompts" else read_conversations
    with pytest.raises(DataError, match=message) as err:
        reader(path)
    where = f"{path}:{line}:" if line is not None else f"{path}:"
    assert str(err.value).startswith(where)
    assert err.value.line == line and err.value.path == str(path)


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_prompts(tmp_path / "nope.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not valid UTF-8"):
        read_prompts(bad)


def test_role_mapping_and_drop_reasons(tmp_path):
    rows = [
        {"id": 7, "conversations": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "chatgpt", "value": "a"}]},
        {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                           {"role": "bard", "content": "a"}, {"role": "tool", "content": "t"},
                           {"role": "user", "content": "q2"}, {"role": "bing", "content": "a2"}]},
        {"conversations": [{"role": "gpt", "content": "a"}, {"role": "user", "content": "q"}]},
        {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
        {"conversations": [{"role": "system", "content": "only system"}]},
        {"conversations": [{"role": "user", "content": "only a prompt"}], "domain": "math"},
    ]  # fmt: skip
    path = write_lines(tmp_path / "c.jsonl", [json.dumps(r) for r in rows])
    convs, stats = read_conversations(path)
    assert stats.read == 7 and stats.kept == 4 and stats.num_dropped == 3
    assert stats.dropped == {
        "does not start with a user turn": 1,
        "empty content": 1,
        "no user or assistant turns": 1,
    }
    assert "read 7, kept 4, dropped 3" in stats.summary()
    assert "1 empty content" in stats.summary()
    assert convs[0].id == 7 and convs[1].id == 1  # explicit id, else row index
    assert [m.role for m in convs[0].messages] == ["user", "assistant"]
    assert convs[1].as_dicts() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert [(m.role, m.content) for m in convs[2].messages] == [
        ("user", "q"), ("assistant", "a"), ("user", "q2"), ("assistant", "a2"),
    ]  # fmt: skip
    assert convs[3].domain == "math" and convs[3].user_turns() == ("only a prompt",)
    kept_sys, _ = read_conversations(path, keep_system=True)
    assert kept_sys[2].messages[0].role == "system"
    # conversation rows are valid prompt rows too (user turns only)
    prompts, pstats = read_prompts(path)
    assert pstats.kept == 4 and prompts[2].turns == ("q", "q2")
    assert ReadStats("a", 2, 1).merge(stats).read == 9


def test_prompt_rows_with_empty_turns_are_dropped(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl", ['{"turns": []}', '{"turns": [""]}', '{"turns": ["x"]}']
    )
    prompts, stats = read_prompts(path)
    assert [p.turns for p in prompts] == [("x",)] and prompts[0].id == 2
    assert stats.dropped == {"no turns": 1, "empty turn": 1}


# ------------------------------------------------------------------------------------------------
# Rendering and the loss mask


def test_single_turn_mask_is_assistant_content_plus_end_of_turn(tok):
    conv = Conversation.from_pairs(("user", "What is 6 * 7?"), ("assistant", "It is 42.\nDone."))
    sample = encode_conversation(tok, conv, CFG)
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert sample.input_ids.shape == sample.loss_mask.shape
    runs, rest = masked_runs(tok, sample)
    assert runs == ["It is 42.\nDone." + EOT]
    assert rest == "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(sample.input_ids) == rest + runs[0]


def test_multi_turn_mask_and_default_system_prompt(tok):
    conv = Conversation.from_pairs(
        ("user", "Explain the assert statement."),
        ("assistant", "Assertions check conditions."),
        ("user", "Go on."),
        ("assistant", "They are removed with -O."),
    )
    cfg = RenderConfig(max_length=512, min_loss_tokens=1, default_system_prompt="Be brief.")
    sample = encode_conversation(tok, conv, cfg)
    runs, rest = masked_runs(tok, sample)
    assert runs == ["Assertions check conditions." + EOT, "They are removed with -O." + EOT]
    assert rest.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert "<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n" in rest
    # a sample-provided system message overrides the default
    with_sys = Conversation((conv.messages[0].__class__("system", "Mine."),) + conv.messages)
    runs2, rest2 = masked_runs(tok, encode_conversation(tok, with_sys, cfg))
    assert runs2 == runs and "Be brief." not in rest2 and "Mine." in rest2


def test_truncation_clips_sequence_and_mask(tok):
    answer = "word " * 200
    conv = Conversation.from_pairs(("user", "Say words."), ("assistant", answer.strip()))
    full = encode_conversation(tok, conv, CFG)
    assert len(full) > 64
    cut = encode_conversation(tok, conv, RenderConfig(max_length=64, min_loss_tokens=1))
    assert len(cut) == 64
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:64])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:64])
    runs, _ = masked_runs(tok, cut)
    assert cut.loss_mask[-1] == 1 and len(runs) == 1
    assert runs[0].startswith("word word") and "<|im_end|>" not in runs[0]
    # the whole answer beyond max_length: nothing supervised → dropped
    none = encode_conversation(tok, conv, RenderConfig(max_length=8, min_loss_tokens=0))
    assert none is None


def test_min_loss_tokens_drops_short_samples(tok):
    short = Conversation.from_pairs(("user", "Hi"), ("assistant", "Yo"), id="short")
    long = Conversation.from_pairs(("user", "Hi"), ("assistant", "Step 1: 1 + 1 = 2. " * 3), id=1)
    prompt_only = Conversation.from_pairs(("user", "Hi"), id=2)
    n_short = encode_conversation(tok, short, CFG).num_loss_tokens
    cfg = RenderConfig(max_length=512, min_loss_tokens=n_short + 1)
    samples, stats = encode_conversations(tok, [short, long, prompt_only], cfg, source="x")
    assert [s.id for s in samples] == [1]
    assert stats.read == 3 and stats.kept == 1
    assert stats.dropped == {f"fewer than {n_short + 1} loss tokens": 2}
    samples, _ = encode_conversations(tok, [short, long], RenderConfig(min_loss_tokens=n_short))
    assert [s.id for s in samples] == ["short", 1]


_content = st.text(
    alphabet=st.sampled_from(list("abcxyz019 .,:*=+-()\n")), min_size=1, max_size=40
).filter(lambda s: not s[0].isspace())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_content, _content), min_size=1, max_size=3))
def test_mask_property_masked_text_is_exactly_assistant_turns(tok, turns):
    conv = Conversation.from_pairs(*[p for u, a in turns for p in (("user", u), ("assistant", a))])
    sample = encode_conversation(tok, conv, RenderConfig(max_length=4096, min_loss_tokens=0))
    runs, _ = masked_runs(tok, sample)
    assert "".join(runs) == "".join(a + EOT for _, a in turns)
    assert sample.num_loss_tokens == sum(
        len(tok(a + EOT, add_special_tokens=False)["input_ids"]) for _, a in turns
    )


def test_char_spans_gemma_style_skips_thought_prefix(tmp_path_factory):
    cfg = RenderConfig.gemma4()
    pre = cfg.assistant_content_prefix
    text = f"<|turn>user\nq<turn|>\n<|turn>model\n{pre}ans<turn|>\n<|turn>model\nopen"
    spans = assistant_char_spans(text, cfg)
    assert [text[s:e] for s, e in spans] == ["ans<turn|>\n", "open"]
    assert RenderConfig.qwen3().default_system_prompt == "You are a helpful assistant."
    with pytest.raises(ValueError, match="max_length"):
        RenderConfig(max_length=0)
    # the pipeline's choice by target (Pipeline.render_config): a Gemma 4 checkpoint's
    # conversations, rendered by a Gemma-4-style template, are supervised on the model turns'
    # content and `<turn|>\n`, never on the thought prefix, the headers or the user turns
    assert RenderConfig.for_target("qwen3", max_length=9) == RenderConfig.qwen3(max_length=9)
    assert RenderConfig.for_target(None) == RenderConfig()
    rc = RenderConfig.for_target("gemma4", max_length=512, min_loss_tokens=1)
    assert rc == RenderConfig.gemma4(max_length=512, min_loss_tokens=1)
    gtok = gemma4_style_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")
    conv = Conversation.from_pairs(("user", "What is 2+2?"), ("assistant", "It is 4."),
                                   ("user", "And 3+3?"), ("assistant", "6."))  # fmt: skip
    sample = encode_conversation(gtok, conv, rc)
    runs, rest = masked_runs(gtok, sample)
    assert runs == ["It is 4.<turn|>\n", "6.<turn|>\n"]
    assert rest.count(pre) == 2 and "system" not in rest and rest.count("<|turn>model\n") == 2


# ------------------------------------------------------------------------------------------------
# Prompts and batching


def test_format_prompt_single_and_multi_turn(tok):
    assert format_prompt(tok, "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    text = format_prompt(tok, msgs, enable_thinking=True)
    assert text.endswith("<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")
    assert "system" not in text
    ids = encode_prompt(tok, "hi")
    assert ids.dtype == np.int32 and tok.decode(ids) == format_prompt(tok, "hi")
    with pytest.raises(ValueError, match="end with a user message"):
        format_prompt(tok, msgs[:2])


def _sample(n, fill=5):
    return TokenizedSample(np.full(n, fill, np.int32), (np.arange(n) % 2).astype(np.uint8), id=n)


def test_pad_to_bucket_shapes_and_padding():
    batch = pad_to_bucket([_sample(3), _sample(130)], buckets=(128, 256, 512), pad_id=9)
    assert batch.input_ids.shape == (2, 256) and batch.loss_mask.shape == (2, 256)
    assert batch.input_ids.dtype == np.int32 and batch.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(batch.lengths, [3, 130])
    assert (batch.input_ids[0, 3:] == 9).all() and batch.loss_mask[0, 3:].sum() == 0
    assert batch.attention_mask.sum() == 133
    filled = pad_to_bucket([_sample(3)], buckets=(8,), batch_size=4)
    assert filled.input_ids.shape == (4, 8) and list(filled.lengths) == [3, 0, 0, 0]
    with pytest.raises(ValueError, match="largest bucket 512"):
        pad_to_bucket([_sample(600)], buckets=(128, 256, 512))


def test_make_batches_static_shapes_every_sample_once():
    samples = [_sample(n) for n in (5, 100, 129, 200, 300, 7, 8, 127)]
    batches = make_batches(samples, 3, buckets=(128, 256, 512), seed=0)
    assert {b.input_ids.shape for b in batches} <= {(3, 128), (3, 256), (3, 512)}
    seen = sorted(int(n) for b in batches for n in b.lengths if n > 0)
    assert seen == sorted(len(s) for s in samples)
    again = make_batches(samples, 3, buckets=(128, 256, 512), seed=0)
    assert [b.lengths.tolist() for b in batches] == [b.lengths.tolist() for b in again]
    full_only = make_batches(samples, 3, buckets=(128, 256, 512), drop_remainder=True)
    assert all((b.lengths > 0).all() for b in full_only)


# ------------------------------------------------------------------------------------------------
# Writing


def test_conversation_and_prompt_writers_round_trip(tmp_path):
    convs = [
        Conversation.from_pairs(("user", "q1 ü"), ("assistant", "a1"), id=0, domain="code"),
        Conversation.from_pairs(("user", "q2"), ("assistant", "a2"), ("user", "q3"), id="x"),
    ]
    assert write_conversations(tmp_path / "sub" / "c.jsonl", convs) == 2
    back, stats = read_conversations(tmp_path / "sub" / "c.jsonl")
    assert back == convs and stats.kept == 2
    prompts = [Prompt(("a", "b"), id=3, domain="prose", source="t")]
    write_prompts(tmp_path / "p.jsonl", prompts)
    assert read_prompts(tmp_path / "p.jsonl")[0] == prompts


def test_atomic_writer_leaves_no_partial_file(tmp_path):
    path = tmp_path / "out.jsonl"

    def rows(fail_at):
        for i in range(10):
            if i == fail_at:
                raise KeyboardInterrupt("interrupted mid-write")
            yield {"conversations": [{"role": "user", "content": f"q{i}"}]}

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(path, rows(fail_at=5))
    assert not path.exists() and os.listdir(tmp_path) == []
    write_jsonl(path, rows(fail_at=None))
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        write_jsonl(path, rows(fail_at=3))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["out.jsonl"]
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("partial")
            raise RuntimeError("boom")
    assert path.read_bytes() == before


# ------------------------------------------------------------------------------------------------
# TensorFlow Datasets (optional extra; a real dataset built by tfds: tests/test_tfds.py)


def test_tfds_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r"dspark-jax\[tfds\]"):
        read_tfds("anything")
