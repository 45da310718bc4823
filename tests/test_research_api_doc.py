"""Every python block of docs/RESEARCH_API.md runs as written (tiny models, seconds each)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "RESEARCH_API.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_examples():
    assert len(BLOCKS) >= 5, "docs/RESEARCH_API.md lost its examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index, capsys):
    code = BLOCKS[index]
    line = DOC.read_text().split(code, 1)[0].count("\n") + 1
    exec(compile(code, f"{DOC}:{line}", "exec"), {"__name__": "research_api_doc"})
    assert capsys.readouterr().out.strip(), "each example prints what it computed"
