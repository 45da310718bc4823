"""Embedded corpus: determinism, no train/held-out leakage, bounded sizes, correct math, cache."""

import json
import random
import re

import pytest

from dspark_jax.demo.corpus import (
    DOMAINS,
    CorpusConfig,
    build_corpus,
    math_problem,
    sample_text,
    stdlib_files,
)
from dspark_jax.train.data import read_conversations, read_prompts

SMALL = dict(max_code_files=24, max_prose_topics=10, n_math=80, n_heldout=8)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("corpus"), seed=3, **SMALL)


def _read_all(files):
    train, tstats = read_conversations(files.train_conversations)
    assert tstats.kept == tstats.read  # every written row passes validation
    held = {}
    for d in DOMAINS:
        prompts, pstats = read_prompts(files.heldout[d])
        assert pstats.kept == pstats.read
        held[d] = prompts
    return train, held


def test_same_seed_same_bytes_other_seed_differs(small, tmp_path):
    again = build_corpus(tmp_path / "again", seed=3, **SMALL)
    for name, path in small.paths().items():
        assert path.read_bytes() == again.paths()[name].read_bytes(), name
    other = build_corpus(tmp_path / "other", seed=4, **SMALL)
    assert other.train_conversations.read_bytes() != small.train_conversations.read_bytes()


def test_all_domains_present_and_heldout_disjoint(small):
    train, held = _read_all(small)
    for d in DOMAINS:
        assert any(c.domain == d for c in train), d
        assert len(held[d]) == SMALL["n_heldout"] and all(p.domain == d for p in held[d])
    for d in ("code", "prose"):  # split by source file / topic
        train_sources = {c.source for c in train if c.domain == d}
        held_sources = {p.source for p in held[d]}
        assert held_sources and not held_sources & train_sources, d
    train_user_turns = {t for c in train for t in c.user_turns()}
    for d in DOMAINS:
        first_turns = {p.turns[0] for p in held[d]}
        assert not first_turns & train_user_turns, d
    assert len({c.id for c in train}) == len(train)
    assert any(len(c.messages) == 4 for c in train if c.domain == "prose")
    assert small.stats["domains"]["math"]["train_conversations"] == SMALL["n_math"]


def test_sizes_are_bounded(small):
    train, held = _read_all(small)
    cfg = CorpusConfig()
    for c in train:
        for m in c.messages:
            if m.role == "assistant":
                assert cfg.min_answer_chars <= len(m.content) <= cfg.max_chars_per_answer
            else:
                assert 0 < len(m.content) <= cfg.max_prompt_chars
    assert all(len(t) <= cfg.max_prompt_chars for ps in held.values() for p in ps for t in p.turns)
    text = small.text.read_text(encoding="utf-8")
    assert len(text) == small.stats["text_chars"] and "Continue this Python module" in text


_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_math_solutions_are_correct_and_end_with_the_answer():
    rng = random.Random(0)
    templates = set()
    for _ in range(400):
        name, question, solution = math_problem(rng)
        templates.add(name)
        lines = solution.split("\n")
        assert re.fullmatch(r"The answer is -?\d+\.", lines[-1]), solution
        assert all(line.startswith(f"Step {i + 1}: ") for i, line in enumerate(lines[:-1]))
        steps = _STEP.findall(solution)
        assert steps, solution
        for a, op, b, c in steps:
            a, b, c = int(a), int(b), int(c)
            expect = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}
            assert expect[op] == c, (question, solution)
        assert int(lines[-1].split()[-1].rstrip(".")) == int(steps[-1][3])
    assert len(templates) >= 4


def test_stdlib_selection_skips_tests_and_site_packages():
    files = stdlib_files()
    assert len(files) > 200
    for rel, _ in files:
        parts = rel.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "pydoc_data"} & set(parts)
        assert rel.endswith(".py")
    assert [r for r, _ in files] == sorted(r for r, _ in files)


def test_cache_skips_rebuild_and_detects_changes(small, tmp_path):
    stamp = small.meta.stat().st_mtime_ns
    cached = build_corpus(small.out_dir, seed=3, **SMALL)
    assert small.meta.stat().st_mtime_ns == stamp and cached.stats == small.stats
    out = tmp_path / "c"
    build_corpus(out, seed=3, **SMALL)
    meta = json.loads((out / "corpus_meta.json").read_text())
    assert meta["params"]["config"]["seed"] == 3
    changed = build_corpus(out, seed=3, **{**SMALL, "n_math": 90})
    assert changed.stats["domains"]["math"]["train_conversations"] == 90
    (out / "heldout_math.jsonl").unlink()  # a missing output forces a rebuild
    assert build_corpus(out, seed=3, **{**SMALL, "n_math": 90}).heldout["math"].is_file()
    with pytest.raises(TypeError, match="unknown CorpusConfig field"):
        build_corpus(out, n_maths=3)
    with pytest.raises(ValueError, match="heldout_fraction"):
        CorpusConfig(heldout_fraction=1.5)


def test_sample_text_is_deterministic_and_covers_domains():
    a = sample_text(60_000)
    assert a == sample_text(60_000) and 30_000 < len(a) <= 60_000
    assert "The answer is" in a and "def " in a


def test_loss_mask_covers_exactly_the_answers(small, tmp_path_factory):
    from dspark_jax.templates import RenderConfig
    from dspark_jax.testing import tiny_tokenizer
    from dspark_jax.train.data import encode_conversations

    tok = tiny_tokenizer(tmp_path_factory.getbasetemp() / "tok_cache")
    train, _ = _read_all(small)
    samples, stats = encode_conversations(tok, train, RenderConfig(min_loss_tokens=1))
    assert stats.kept == len(train)
    for conv, sample in zip(train, samples):
        masked = tok.decode(sample.input_ids[sample.loss_mask == 1].tolist())
        expected = "".join(
            m.content + "<|im_end|>\n" for m in conv.messages if m.role == "assistant"
        )
        assert masked == expected, conv.id
