"""The code and prose domains of the demo corpus: chats from the standard library's `.py`
files and from `pydoc_data.topics` (see corpus.py)."""

from __future__ import annotations

import ast
import os
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from pydoc_data.topics import topics as pydoc_topics

from dspark_jax.config.corpus import CorpusConfig
from dspark_jax.demo.corpus_common import _cut_text, _rng
from dspark_jax.train.data import Conversation

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
