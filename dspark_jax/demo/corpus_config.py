"""The embedded demo corpus's parameters (`CorpusConfig`), its file layout (`CorpusFiles`) and
the seeded helpers every domain shares (see corpus.py)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

CORPUS_VERSION = 2  # bump whenever generation changes: it is part of the cache key
DOMAINS = ("code", "prose", "math")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """Parameters of the embedded corpus (all recorded in ``corpus_meta.json``).

    seed: the only source of randomness (file/topic split, windows, math problems, order).
    max_chars_per_answer: upper bound on every assistant answer (the target model is tiny).
    max_prompt_chars: upper bound on every user turn.
    min_answer_chars: shorter candidate answers are skipped.
    n_math: generated training math problems.
    n_heldout: prompts per domain in each ``heldout_<domain>.jsonl``.
    heldout_fraction: minimum share of stdlib files / pydoc topics reserved for held-out prompts
        (more are reserved, up to half, until they yield `n_heldout` chats).
    max_code_files / max_prose_topics: caps on the sources used, train and held-out together
        (``None`` = all), for quick corpora.
    code_windows_per_file / code_functions_per_file: chats drawn from each stdlib file.
    max_file_bytes: larger stdlib files are skipped.
    two_turn_fraction: share of prose chats that continue with a second user turn.
    """

    seed: int = 0
    max_chars_per_answer: int = 480
    max_prompt_chars: int = 360
    min_answer_chars: int = 60
    n_math: int = 3000
    n_heldout: int = 64
    heldout_fraction: float = 0.1
    max_code_files: int | None = None
    max_prose_topics: int | None = None
    code_windows_per_file: int = 2
    code_functions_per_file: int = 3
    max_file_bytes: int = 150_000
    two_turn_fraction: float = 0.2

    def __post_init__(self):
        if self.max_chars_per_answer < self.min_answer_chars or self.min_answer_chars < 1:
            raise ValueError(
                "CorpusConfig needs 1 ≤ min_answer_chars ≤ max_chars_per_answer, got "
                f"{self.min_answer_chars} and {self.max_chars_per_answer}"
            )
        if self.max_prompt_chars < 80:
            raise ValueError(
                f"CorpusConfig.max_prompt_chars must be ≥ 80, got {self.max_prompt_chars}"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for name in ("n_math", "n_heldout", "code_windows_per_file", "code_functions_per_file"):
            if getattr(self, name) < 0:
                raise ValueError(f"CorpusConfig.{name} must be ≥ 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class CorpusFiles:
    """Paths written by `build_corpus` and the statistics recorded with them."""

    out_dir: Path
    train_conversations: Path
    heldout: dict[str, Path]  # domain → prompt JSONL
    text: Path
    meta: Path
    stats: dict[str, Any]

    def paths(self) -> dict[str, Path]:
        """Flat name → path mapping (``heldout_code`` etc.)."""
        out = {
            "train_conversations": self.train_conversations,
            "text": self.text,
            "meta": self.meta,
        }
        out.update({f"heldout_{d}": p for d, p in self.heldout.items()})
        return out


def _rng(seed: int, *stream: str) -> random.Random:
    # String seeds go through SHA-512 in CPython: stable across runs and PYTHONHASHSEED.
    return random.Random(":".join([str(seed), *stream]))


def _split_sources(
    counts: dict[str, int], fraction: float, min_heldout: int, rng: random.Random
) -> tuple[list[str], list[str]]:
    """(train, heldout) partition of source names, sorted.

    Sources are taken in seeded random order into the held-out side until it has at least
    `fraction` of the sources *and* at least `min_heldout` chats (`counts[source]`), but never
    more than half of the sources; at least one source stays on each side when there are ≥ 2.
    """
    order = sorted(counts)
    rng.shuffle(order)
    if len(order) < 2:
        return order, []
    n_min = max(1, round(len(order) * fraction))
    n_max = max(1, len(order) // 2)
    n_held, n_chats = 0, 0
    while n_held < n_max and (n_held < n_min or n_chats < min_heldout):
        n_chats += counts[order[n_held]]
        n_held += 1
    return sorted(order[n_held:]), sorted(order[:n_held])


def _cut_text(text: str, limit: int) -> str:
    """`text` shortened to ≤ `limit` chars, preferably at a line end, else at a space."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    for sep in ("\n", " "):
        i = head.rfind(sep)
        if i >= limit // 2:
            return head[: i + 1] if sep == "\n" else head[:i]
    return head
