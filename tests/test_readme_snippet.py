"""The README's "For researchers" code block runs as written (tiny models, a few seconds)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet(section: str) -> str:
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, re.S)
    assert len(blocks) == 1, f"README section {section!r} needs exactly one python block"
    return blocks[0]


def test_research_api_snippet_runs(capsys):
    code = _snippet("For researchers")
    exec(compile(code, f"{README}:For researchers", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    losses = [float(line.split()[1]) for line in out if line.startswith("loss ")]
    assert len(losses) == 2 and losses[0] != losses[1]  # the variant's weights took effect
    tau = [float(x) for x in out[-1].split("conditional")[0].split()[1:]]
    assert all(1.0 <= t <= 5.0 for t in tau), out[-1]  # γ = 4: τ in [1, 5]
