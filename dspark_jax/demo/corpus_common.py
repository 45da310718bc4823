"""The embedded demo corpus's file layout (`CorpusFiles`) and the seeded helpers every domain
shares (see corpus.py); its parameters (`CorpusConfig`) are in `dspark_jax.config.corpus`."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

CORPUS_VERSION = 2  # bump whenever generation changes: it is part of the cache key
DOMAINS = ("code", "prose", "math")


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
