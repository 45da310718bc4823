"""The embedded demo corpus (docs/ARCHITECTURE.md §8): chats from text every Python install carries.

Three domains, each split into training conversations and a held-out prompt set with no overlap:

* **code**: the standard library's ``.py`` files (tests, site-packages, generated and huge files
  skipped), as "continue this module" and "write the function" chats. Split **by source file**.
* **prose**: `pydoc_data.topics` (the language reference shipped for `help()`), as "explain
  <topic>" chats, some two-turn. Split **by topic**.
* **math**: generated arithmetic word problems (shopping, ages, rates, sharing, multi-step) with
  worked step-by-step solutions ending in "The answer is N.". Split **by random stream**
  (train and held-out use different seeds) and held-out questions that occur in train are
  discarded.

Everything is a function of `CorpusConfig` and the running Python's standard library (whose
version is recorded), so the same seed gives byte-identical files. `build_corpus` writes, each
atomically, and skips the work when the recorded parameters match:

    train_conversations.jsonl   {"id", "conversations": [...], "domain", "source"}
    heldout_code.jsonl          {"id", "turns": [...], "domain", "source"}  (also _prose, _math)
    corpus_text.txt             the training conversations' text, for tokenizer training
    corpus_meta.json            parameters + statistics (written last: the cache key)
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from collections.abc import Iterator
from pydoc_data.topics import topics as pydoc_topics
from typing import Any

from dspark_jax.config.corpus import CorpusConfig
from dspark_jax.demo.corpus_common import CORPUS_VERSION, DOMAINS, CorpusFiles, _rng, _split_sources
from dspark_jax.demo.corpus_math import MATH_TEMPLATES, math_chats, math_problem
from dspark_jax.demo.corpus_sources import code_chats, prose_chats, stdlib_files
from dspark_jax.io import atomic_write
from dspark_jax.storage import as_path
from dspark_jax.train.data import Conversation, Prompt, write_conversations, write_prompts

# ------------------------------------------------------------------------------------------------
# Building


def _as_prompts(convs: list[Conversation], n: int, rng: random.Random) -> list[Prompt]:
    picked = sorted(rng.sample(range(len(convs)), min(n, len(convs))))
    return [
        Prompt(convs[i].user_turns(), id=k, domain=convs[i].domain, source=convs[i].source)
        for k, i in enumerate(picked)
    ]


def _by_source(convs: list[Conversation]) -> dict[str, list[Conversation]]:
    out: dict[str, list[Conversation]] = {}
    for c in convs:
        out.setdefault(c.source, []).append(c)
    return out


def _cap_sources(names: list[str], cap: int | None, rng: random.Random) -> list[str]:
    names = sorted(names)
    return names if cap is None or cap >= len(names) else sorted(rng.sample(names, cap))


def _split_chats(
    by_source: dict[str, list[Conversation]], cfg: CorpusConfig, domain: str
) -> tuple[list[Conversation], list[Prompt]]:
    counts = {src: len(cs) for src, cs in by_source.items()}
    train_src, held_src = _split_sources(
        counts, cfg.heldout_fraction, cfg.n_heldout, _rng(cfg.seed, "split", domain)
    )
    train = [c for src in train_src for c in by_source[src]]
    held = [c for src in held_src for c in by_source[src]]
    return train, _as_prompts(held, cfg.n_heldout, _rng(cfg.seed, "pick", domain))


def generate_corpus(cfg: CorpusConfig) -> tuple[list[Conversation], dict[str, list[Prompt]]]:
    """In memory: (shuffled training conversations with ids, held-out prompts per domain).

    Code and prose are split by source (stdlib file, pydoc topic), so no held-out source
    contributes a training chat; math held-out problems come from another random stream and
    never repeat a training question.
    """
    by_rel = dict(stdlib_files(cfg.max_file_bytes))
    rels = _cap_sources(list(by_rel), cfg.max_code_files, _rng(cfg.seed, "cap", "code"))
    code = _by_source(code_chats([(r, by_rel[r]) for r in rels], cfg, "chats"))
    topics = _cap_sources(list(pydoc_topics), cfg.max_prose_topics, _rng(cfg.seed, "cap", "prose"))
    prose = _by_source(prose_chats(topics, cfg, "chats"))

    code_train, code_held = _split_chats(code, cfg, "code")
    prose_train, prose_held = _split_chats(prose, cfg, "prose")
    math_train = math_chats(cfg.n_math, cfg.seed, "train")
    train_questions = frozenset(c.messages[0].content for c in math_train)
    math_held = math_chats(cfg.n_heldout, cfg.seed, "heldout", exclude=train_questions)
    heldout = {
        "code": code_held,
        "prose": prose_held,
        "math": _as_prompts(math_held, cfg.n_heldout, _rng(cfg.seed, "pick", "math")),
    }
    train = code_train + prose_train + math_train
    _rng(cfg.seed, "order").shuffle(train)
    train = [dataclasses.replace(c, id=i) for i, c in enumerate(train)]
    return train, heldout


def _params(cfg: CorpusConfig) -> dict[str, Any]:
    return {
        "version": CORPUS_VERSION,
        "python": ".".join(map(str, sys.version_info[:3])),
        "config": dataclasses.asdict(cfg),
    }


def _stats(train: list[Conversation], heldout: dict[str, list[Prompt]]) -> dict[str, Any]:
    per_domain: dict[str, Any] = {}
    for d in DOMAINS:
        convs = [c for c in train if c.domain == d]
        answers = [m.content for c in convs for m in c.messages if m.role == "assistant"]
        per_domain[d] = {
            "train_conversations": len(convs),
            "train_sources": len({c.source for c in convs}),
            "multi_turn": sum(1 for c in convs if len(c.messages) > 2),
            "answer_chars": sum(len(a) for a in answers),
            "mean_answer_chars": round(sum(len(a) for a in answers) / max(1, len(answers)), 1),
            "heldout_prompts": len(heldout[d]),
            "heldout_sources": len({p.source for p in heldout[d]}),
        }
    return {"train_conversations": len(train), "domains": per_domain}


def _corpus_text(train: list[Conversation]) -> Iterator[str]:
    for c in train:
        for m in c.messages:
            yield m.content.rstrip("\n") + "\n\n"


def build_corpus(
    out_dir: str | os.PathLike,
    config: CorpusConfig | None = None,
    *,
    force: bool = False,
    **overrides: Any,
) -> CorpusFiles:
    """Write the corpus files into `out_dir` (see module docstring); return their paths + stats.

    `overrides` are `CorpusConfig` fields (`build_corpus(d, seed=1, n_math=500)`); an unknown name
    is an error. When ``corpus_meta.json`` records the same parameters (config, corpus version,
    Python version) and every file exists, nothing is rebuilt unless `force`.
    """
    fields = {f.name for f in dataclasses.fields(CorpusConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown CorpusConfig field(s) {unknown}; valid: {sorted(fields)}")
    cfg = dataclasses.replace(config or CorpusConfig(), **overrides)
    out = as_path(out_dir)  # a local path or a bucket URL
    files = CorpusFiles(
        out_dir=out,
        train_conversations=out / "train_conversations.jsonl",
        heldout={d: out / f"heldout_{d}.jsonl" for d in DOMAINS},
        text=out / "corpus_text.txt",
        meta=out / "corpus_meta.json",
        stats={},
    )
    params = _params(cfg)
    if not force and files.meta.is_file():
        try:
            meta = json.loads(files.meta.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            meta = {}
        if meta.get("params") == params and all(p.is_file() for p in files.paths().values()):
            return dataclasses.replace(files, stats=meta["stats"])

    train, heldout = generate_corpus(cfg)
    stats = _stats(train, heldout)
    # The meta file is the cache key: remove it first, write it last.
    files.meta.unlink(missing_ok=True)
    write_conversations(files.train_conversations, train)
    for d in DOMAINS:
        write_prompts(files.heldout[d], heldout[d])
    with atomic_write(files.text) as f:
        n_chars = 0
        for piece in _corpus_text(train):
            f.write(piece)
            n_chars += len(piece)
    stats["text_chars"] = n_chars
    with atomic_write(files.meta) as f:
        json.dump({"params": params, "stats": stats}, f, indent=2, sort_keys=True)
    return dataclasses.replace(files, stats=stats)


def sample_text(max_chars: int = 200_000, seed: int = 0) -> str:
    """A quick, deterministic slice of all three domains (for small test tokenizers)."""
    cfg = CorpusConfig(seed=seed, max_code_files=12, max_prose_topics=8, n_math=150)
    parts: list[str] = []
    files = stdlib_files()
    rng = _rng(seed, "sample-text")
    picked = sorted(rng.sample(range(len(files)), min(cfg.max_code_files, len(files))))
    convs = code_chats([files[i] for i in picked], cfg, "sample")

    topics = sorted(rng.sample(sorted(pydoc_topics), min(cfg.max_prose_topics, len(pydoc_topics))))
    convs += prose_chats(topics, cfg, "sample") + math_chats(cfg.n_math, seed, "sample")
    per_domain = max_chars // 3
    for d in DOMAINS:
        text = "".join(_corpus_text([c for c in convs if c.domain == d]))
        parts.append(text[:per_domain])
    return "".join(parts)


__all__ = [
    "CORPUS_VERSION",
    "DOMAINS",
    "MATH_TEMPLATES",
    "CorpusConfig",
    "CorpusFiles",
    "build_corpus",
    "code_chats",
    "generate_corpus",
    "math_chats",
    "math_problem",
    "prose_chats",
    "sample_text",
    "stdlib_files",
]
