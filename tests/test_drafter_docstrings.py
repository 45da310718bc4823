"""The drafters' docstrings name the `Proposal` fields that exist.

Every docstring in dspark_jax/drafters/*.py that describes a `Proposal` ("-> Proposal: tokens
[B, γ] ..., probs ...") is parsed: each name given a shape ("name [B, ...]") in the sentence after
the word `Proposal`, and each attribute read off a proposal in the text ("proposal.name",
"Proposal.name"), must be a field of the dataclass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dspark_jax import drafters
from dspark_jax.drafters.common import Proposal

DRAFTERS = Path(drafters.__file__).resolve().parent
SENTENCE = re.compile(r"\bProposal\b(.*?)(?:\.\s|\.$|$)", re.S)  # up to the sentence's end
SHAPED = re.compile(r"\b([A-Za-z_]\w*) \[")  # "tokens [B, γ]"
ATTRIBUTE = re.compile(r"\b(?:[Pp]roposal|prop)\.([A-Za-z_]\w*)")


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc:
            yield getattr(node, "name", "<module>"), doc


def named_fields(doc: str) -> set[str]:
    """The Proposal fields a docstring names."""
    names = {m for s in SENTENCE.findall(doc) for m in SHAPED.findall(s)}
    return names | set(ATTRIBUTE.findall(doc))


def test_docstrings_name_only_real_proposal_fields():
    fields = set(Proposal._fields)
    seen = {}
    for path in sorted(DRAFTERS.glob("*.py")):
        for name, doc in _docstrings(path):
            for field in named_fields(doc):
                seen.setdefault(field, []).append(f"{path.name}:{name}")
    wrong = {f: where for f, where in seen.items() if f not in fields}
    assert not wrong, f"docstrings name Proposal fields that do not exist: {wrong}; {fields=}"
    # the package docstring describes the whole Proposal (so the check above is not vacuous)
    assert named_fields(drafters.__doc__) == fields


def test_the_parser_catches_a_wrong_name():
    doc = "-> Proposal: draft_tokens [B, γ] int32, probs [B, γ, V]. Then x [B] is other."
    assert named_fields(doc) == {"draft_tokens", "probs"}
    assert named_fields("read proposal.conf and prop.tokens") == {"conf", "tokens"}
