"""The embedded demo corpus's parameters (`CorpusConfig`; the generator is `dspark_jax.demo`)."""

from __future__ import annotations

import dataclasses


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
