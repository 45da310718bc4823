"""The embedded demo corpus: chats built from text every Python install carries (DESIGN §6).

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

import ast
import dataclasses
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dspark_jax.io import atomic_write
from dspark_jax.train.data import (
    Conversation,
    Prompt,
    write_conversations,
    write_prompts,
)

CORPUS_VERSION = 2  # bump whenever generation changes: it is part of the cache key
DOMAINS = ("code", "prose", "math")

# Directories under the stdlib never used: tests, third-party packages, data-only or generated code.
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",  # codec tables
        "pydoc_data",  # the prose domain's source; keeping it would leak held-out topics
        "__phello__",
        "ensurepip",
    }
)
_SKIP_FILES = frozenset({"this.py", "antigravity.py", "__hello__.py"})


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


# ------------------------------------------------------------------------------------------------
# Code: the standard library


def stdlib_files(max_file_bytes: int = 150_000) -> list[tuple[str, Path]]:
    """Sorted `(relative_path, path)` of usable stdlib ``.py`` files (POSIX relative paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in _SKIP_DIRS and not d.startswith((".", "config-")) and "-" not in d
        )
        for name in sorted(filenames):
            if not name.endswith(".py") or name in _SKIP_FILES or name.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if 1000 <= size <= max_file_bytes:
                out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text.replace("\r\n", "\n").expandtabs(4)


def _take_lines(lines: list[str], start: int, limit: int) -> tuple[str, int]:
    """Whole lines from `start` while the total stays ≤ `limit`; returns (text, next_index)."""
    text, i = "", start
    while i < len(lines) and len(text) + len(lines[i]) <= limit:
        text += lines[i]
        i += 1
    return text, i


def _continuation_chats(
    module: str, lines: list[str], cfg: CorpusConfig, rng: random.Random
) -> Iterator[tuple[str, str]]:
    """(prompt, answer) pairs "continue this module" from the file start and block starts."""
    starts = [0]
    block_starts = [
        i
        for i, line in enumerate(lines)
        if i > 0 and line.lstrip().startswith(("def ", "class ", "async def ", "@"))
    ]
    k = max(0, cfg.code_windows_per_file - 1)
    starts += sorted(rng.sample(block_starts, min(k, len(block_starts))))
    header = f"Continue this Python module ({module}):\n\n"
    for start in starts[: cfg.code_windows_per_file]:
        budget = cfg.max_prompt_chars - len(header)
        target = rng.randint(min(120, budget), budget)
        shown, nxt = _take_lines(lines, start, target)
        answer, _ = _take_lines(lines, nxt, cfg.max_chars_per_answer)
        # Leading blank lines would merge with the assistant header's newline into one BPE
        # pre-token and blur the loss-mask boundary; the continuation starts at code instead.
        answer = re.sub(r"\A(?:[ \t]*\n)+", "", answer).rstrip() + "\n"
        if not shown.strip() or len(answer.strip()) < cfg.min_answer_chars:
            continue
        yield header + shown, answer


def _function_chats(
    module: str, source: str, cfg: CorpusConfig, rng: random.Random
) -> Iterator[tuple[str, str]]:
    """(prompt, answer) pairs "write the function" for short top-level functions and methods."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    found: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.append((f"{node.name}.{sub.name}", sub))
    eligible = []
    for qualname, node in found:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        body = textwrap.dedent("".join(lines[first : node.end_lineno])).rstrip() + "\n"
        if cfg.min_answer_chars <= len(body) <= cfg.max_chars_per_answer:
            doc = ast.get_docstring(node) or ""
            eligible.append((qualname, body, doc.strip().split("\n")[0].strip()))
    picked = sorted(
        rng.sample(range(len(eligible)), min(cfg.code_functions_per_file, len(eligible)))
    )
    for i in picked:
        qualname, body, doc = eligible[i]
        kind = "method" if "." in qualname else "function"
        phrasing = rng.choice(
            [
                f"Write the {kind} `{qualname}` from the Python module `{module}`.",
                f"Implement `{qualname}` as it is written in the `{module}` module.",
                f"Show the source code of the {kind} `{qualname}` in `{module}`.",
            ]
        )
        if doc:
            phrasing += f" Its docstring starts: {doc}"
        yield _cut_text(phrasing, cfg.max_prompt_chars), body


def code_chats(files: list[tuple[str, Path]], cfg: CorpusConfig, stream: str) -> list[Conversation]:
    """Single-turn code chats from `files`; each file's chats depend only on (seed, stream, file)."""
    out = []
    for rel, path in files:
        source = _read_source(path)
        if source is None:
            continue
        rng = _rng(cfg.seed, "code", stream, rel)
        module = _module_name(rel)
        lines = source.splitlines(keepends=True)
        pairs = list(_continuation_chats(module, lines, cfg, rng))
        pairs += list(_function_chats(module, source, cfg, rng))
        for prompt, answer in pairs:
            out.append(
                Conversation.from_pairs(
                    ("user", prompt), ("assistant", answer), domain="code", source=rel
                )
            )
    return out


# ------------------------------------------------------------------------------------------------
# Prose: pydoc topics

_UNDERLINE = re.compile(r"^([=\-*~^\"+#])\1{2,}\s*$")


def _topic_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(title, [(heading, paragraph), ...]) of one pydoc topic; headings from underlined lines."""
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    title, heading, out = "", "", []
    for para in paragraphs:
        plines = para.split("\n")
        if len(plines) >= 2 and _UNDERLINE.match(plines[1]):
            heading = plines[0].strip()
            title = title or heading
            rest = "\n".join(plines[2:]).strip("\n")
            if not rest:
                continue
            para = rest
        out.append((heading, para))
    return title, out


def _chunk_topic(text: str, limit: int) -> tuple[str, list[tuple[str, str]]]:
    """(title, [(heading, chunk ≤ limit chars), ...]) with paragraphs packed greedily."""
    title, sections = _topic_sections(text)
    chunks: list[tuple[str, str]] = []
    cur_heading, cur = "", ""
    for heading, para in sections:
        while len(para) > limit:  # an over-long paragraph is split at a line or space
            piece = _cut_text(para, limit)
            sections_piece, para = piece.rstrip(), para[len(piece) :].lstrip("\n ")
            if cur:
                chunks.append((cur_heading, cur))
                cur = ""
            chunks.append((heading, sections_piece))
        if not para:
            continue
        if cur and len(cur) + 2 + len(para) <= limit:
            cur += "\n\n" + para
        else:
            if cur:
                chunks.append((cur_heading, cur))
            cur_heading, cur = heading, para
    if cur:
        chunks.append((cur_heading, cur))
    return title, chunks


def _topic_subject(topic: str, title: str) -> str:
    return title if title else f'the "{topic}" topic'


def prose_chats(topics: list[str], cfg: CorpusConfig, stream: str) -> list[Conversation]:
    """Prose chats from pydoc topics; a share of them continue with a second user turn.

    Each topic's chats depend only on (seed, stream, topic)."""
    from pydoc_data.topics import topics as pydoc_topics

    out = []
    for topic in topics:
        rng = _rng(cfg.seed, "prose", stream, topic)
        title, chunks = _chunk_topic(pydoc_topics[topic], cfg.max_chars_per_answer)
        subject = _topic_subject(topic, title)
        chunks = [(h, c) for h, c in chunks if len(c) >= cfg.min_answer_chars]
        i = 0
        while i < len(chunks):
            heading, chunk = chunks[i]
            if i == 0:
                first = rng.choice(
                    [
                        f"Explain {subject} in Python.",
                        f"What does the Python reference say about {subject}?",
                        f"Describe {subject} in Python.",
                    ]
                )
            elif heading and heading != title:
                first = f"Explain {heading} ({subject}) in Python."
            else:
                first = f"Continue explaining {subject} in Python, part {i + 1}."
            pairs = [("user", _cut_text(first, cfg.max_prompt_chars)), ("assistant", chunk)]
            if i + 1 < len(chunks) and rng.random() < cfg.two_turn_fraction:
                follow = rng.choice(["Go on.", "Tell me more.", "Continue."])
                pairs += [("user", follow), ("assistant", chunks[i + 1][1])]
                i += 1
            out.append(Conversation.from_pairs(*pairs, domain="prose", source=topic))
            i += 1
    return out


# ------------------------------------------------------------------------------------------------
# Math: generated word problems

_NAMES = (
    ("Ana", "she"), ("Ben", "he"), ("Carla", "she"), ("Dev", "he"), ("Elena", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hugo", "he"), ("Ines", "she"), ("Jamal", "he"),
    ("Kira", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sara", "she"), ("Tom", "he"),
)  # fmt: skip
_ITEMS = (
    "apples", "pencils", "notebooks", "oranges", "stickers", "muffins", "candles", "books",
    "marbles", "cups", "tickets", "bananas", "erasers", "cookies", "balloons", "plants",
)  # fmt: skip
_MACHINES = (("machine", "bolts"), ("printer", "pages"), ("bakery", "loaves"), ("pump", "liters"))
MathProblem = tuple[str, list[str], int]  # (question, solution steps, answer)


def _two_names(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    a, b = rng.sample(_NAMES, 2)
    return a, b


def _shopping(rng: random.Random) -> MathProblem:
    (name, pron), (it1, it2) = rng.choice(_NAMES), rng.sample(_ITEMS, 2)
    a, p, b, q = rng.randint(2, 9), rng.randint(1, 12), rng.randint(2, 9), rng.randint(1, 12)
    c1, c2 = a * p, b * q
    total = c1 + c2
    steps = [
        f"The {it1} cost {a} * {p} = {c1} dollars.",
        f"The {it2} cost {b} * {q} = {c2} dollars.",
        f"Together that is {c1} + {c2} = {total} dollars.",
    ]
    q_text = f"{name} buys {a} {it1} for ${p} each and {b} {it2} for ${q} each."
    if rng.random() < 0.5:
        bill = next(x for x in (20, 50, 100, 200, 500) if x >= total)
        steps.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        pron_c = pron.capitalize()
        return (
            f"{q_text} {pron_c} pays with a ${bill} bill. How much change does {pron} get?",
            steps,
            bill - total,
        )
    return f"{q_text} How much does {pron} spend in total?", steps, total


def _ages(rng: random.Random) -> MathProblem:
    (a, _), (b, _) = _two_names(rng)
    age_b, d, k = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 15)
    age_a = age_b + d
    if rng.random() < 0.5:
        steps = [
            f"{a} is {age_b} + {d} = {age_a} years old now.",
            f"In {k} years {a} will be {age_a} + {k} = {age_a + k} years old.",
        ]
        return (
            f"{a} is {d} years older than {b}. {b} is {age_b} years old. "
            f"How old will {a} be in {k} years?",
            steps,
            age_a + k,
        )
    total = age_a + age_b + 2 * k
    steps = [
        f"{a} is {age_b} + {d} = {age_a} years old now.",
        f"In {k} years {a} will be {age_a} + {k} = {age_a + k} and {b} will be "
        f"{age_b} + {k} = {age_b + k}.",
        f"The sum is {age_a + k} + {age_b + k} = {total}.",
    ]
    return (
        f"{a} is {d} years older than {b}, who is {age_b}. "
        f"What will the sum of their ages be in {k} years?",
        steps,
        total,
    )


def _rates(rng: random.Random) -> MathProblem:
    if rng.random() < 0.5:
        machine, unit = rng.choice(_MACHINES)
        r, h, extra = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        made = r * h
        steps = [
            f"In {h} hours the {machine} makes {r} * {h} = {made} {unit}.",
        ]
        if rng.random() < 0.5:
            return (
                f"A {machine} makes {r} {unit} per hour. How many {unit} does it make in {h} hours?",
                steps,
                made,
            )
        total = made + extra * r
        steps.append(f"In {extra} more hours it makes {r} * {extra} = {extra * r} {unit}.")
        steps.append(f"In total that is {made} + {extra * r} = {total} {unit}.")
        return (
            f"A {machine} makes {r} {unit} per hour. It runs for {h} hours, stops, and then "
            f"runs {extra} more hours. How many {unit} does it make?",
            steps,
            total,
        )
    s1, h1, s2, h2 = rng.randint(20, 90), rng.randint(1, 6), rng.randint(20, 90), rng.randint(1, 6)
    d1, d2 = s1 * h1, s2 * h2
    name, _ = rng.choice(_NAMES)
    steps = [
        f"First part: {s1} * {h1} = {d1} km.",
        f"Second part: {s2} * {h2} = {d2} km.",
        f"Total distance: {d1} + {d2} = {d1 + d2} km.",
    ]
    return (
        f"{name} drives at {s1} km per hour for {h1} hours, then at {s2} km per hour for "
        f"{h2} hours. How many kilometers does {name} drive?",
        steps,
        d1 + d2,
    )


def _sharing(rng: random.Random) -> MathProblem:
    (name, pron), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    k, each = rng.randint(2, 9), rng.randint(2, 12)
    kept = rng.randint(1, 20)
    n = k * each + kept
    steps = [
        f"{name} keeps {kept}, so {n} - {kept} = {n - kept} {item} are shared.",
        f"Each friend gets {n - kept} / {k} = {each} {item}.",
    ]
    return (
        f"{name} has {n} {item}. {pron.capitalize()} keeps {kept} and shares the rest equally "
        f"among {k} friends. How many {item} does each friend get?",
        steps,
        each,
    )


def _multi_step(rng: random.Random) -> MathProblem:
    (name, pron), item = (
        rng.choice(_NAMES),
        rng.choice(("cookies", "muffins", "rolls", "cupcakes", "pies")),
    )
    batches, per = rng.randint(2, 8), rng.randint(6, 24)
    made = batches * per
    box = rng.randint(2, 8)
    boxes = rng.randint(1, max(1, made // box - 1))
    sold = made - boxes * box
    steps = [
        f"{name} makes {batches} * {per} = {made} {item}.",
        f"After selling {sold}, {made} - {sold} = {made - sold} {item} are left.",
        f"That fills {made - sold} / {box} = {boxes} boxes.",
    ]
    return (
        f"{name} bakes {batches} batches of {per} {item}. {pron.capitalize()} sells {sold} of "
        f"them and packs the rest into boxes of {box}. How many boxes does {pron} fill?",
        steps,
        boxes,
    )


def _savings(rng: random.Random) -> MathProblem:
    name, pron = rng.choice(_NAMES)
    x, w = rng.randint(3, 40), rng.randint(2, 12)
    saved = x * w
    y = rng.randint(1, saved)
    steps = [
        f"{name} saves {x} * {w} = {saved} dollars.",
        f"After spending {y} dollars, {saved} - {y} = {saved - y} dollars are left.",
    ]
    return (
        f"{name} saves ${x} every week for {w} weeks and then spends ${y} on a gift. "
        f"How much money does {pron} have left?",
        steps,
        saved - y,
    )


MATH_TEMPLATES: dict[str, Callable[[random.Random], MathProblem]] = {
    "shopping": _shopping,
    "ages": _ages,
    "rates": _rates,
    "sharing": _sharing,
    "multi_step": _multi_step,
    "savings": _savings,
}


def math_problem(rng: random.Random) -> tuple[str, str, str]:
    """(template name, question, worked solution ending in "The answer is N.")."""
    name = rng.choice(sorted(MATH_TEMPLATES))
    question, steps, answer = MATH_TEMPLATES[name](rng)
    steps = [f"Step {i + 1}: {s}" for i, s in enumerate(steps)]
    return name, question, "\n".join(steps + [f"The answer is {answer}."])


def math_chats(n: int, seed: int, stream: str, exclude: frozenset[str] = frozenset()) -> list:
    """`n` distinct math chats from the random stream `stream`, skipping `exclude` questions."""
    rng = _rng(seed, "math", stream)
    seen: set[str] = set(exclude)
    out = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct math problems; lower n_math")
        template, question, solution = math_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append(
            Conversation.from_pairs(
                ("user", question), ("assistant", solution), domain="math", source=template
            )
        )
    return out


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
    from pydoc_data.topics import topics as pydoc_topics

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
    out = Path(out_dir)
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
    from pydoc_data.topics import topics as pydoc_topics

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
