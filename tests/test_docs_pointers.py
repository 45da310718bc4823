"""Every pointer a newcomer follows resolves inside the repository (pure Python: no jax, no import
of the package).

* no citation of the design notes that live outside the repository;
* every `docs/NAME.md §N.M` citation (and the bare `§N.M` that continue it) names an existing file
  and an existing numbered heading of that file;
* every dotted `dspark_jax.a.b` name in a docstring of the package is a module (by file) or a
  top-level name of one (by `ast`), so a renamed or removed module cannot leave stale docstrings;
* every `dspark_jax/...py` or `benchmarks/...py` path in the package's docstrings and comments
  exists;
* the package map (docs/ARCHITECTURE.md §2) lists every module file of `dspark_jax/` exactly once
  and nothing that does not exist.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dspark_jax"
DOCS = ROOT / "docs"

# written in two pieces so that this file does not cite them itself
OUTSIDE = [name + " §" for name in ("REFERENCE", "DESIGN")] + [
    name + ".md" for name in ("REFERENCE", "DESIGN", "STYLE", "PERF_NOTES")
]


def _code_files(with_tests: bool = True) -> list[Path]:
    files = [
        *PKG.rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "configs").glob("*.py"),
    ]
    files += [ROOT / "train.py", ROOT / "serve.py"]
    if with_tests:
        files += [p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name]
    return sorted(files)


def _doc_files() -> list[Path]:
    return sorted([*DOCS.glob("*.md"), ROOT / "README.md"])


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------------------------
# (a) nothing cites a document outside the repository


def test_no_citation_of_documents_outside_the_repository():
    bad = []
    for path in _code_files() + _doc_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{_rel(path)}:{i}: {needle}" for needle in OUTSIDE if needle in line]
    assert not bad, "cite docs/METHOD.md or docs/ARCHITECTURE.md instead:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------
# (b) docs/NAME.md §N.M resolves

_REF = r"§\d+(?:\.\d+)*(?:[–-]\d+(?:\.\d+)*)?"
_SEP = r"(?:\s*,\s*|\s+and\s+|\s*/\s*|\s*\n[\s#]*)"
# a document named by path (code, docs) or by its bare name in docs/ ("METHOD §2.5"), followed by
# one or more section numbers
_CHAIN = re.compile(
    rf"(?P<doc>docs/[A-Za-z_]+\.md|\b[A-Z][A-Z_]{{2,}}(?:\.md)?)\s*(?P<refs>{_REF}(?:{_SEP}{_REF})*)"
)
_ONE = re.compile(_REF)
_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s", re.M)


def _headings(doc: Path) -> set[str]:
    return set(_HEADING.findall(doc.read_text()))


def _doc_path(name: str) -> Path:
    name = name.removeprefix("docs/")
    return DOCS / (name if name.endswith(".md") else name + ".md")


def _numbers(ref: str) -> list[str]:
    """'§2.6–2.8' -> ['2.6', '2.8'] (both ends of a range must exist)."""
    return [n.strip(".") for n in re.split("[–-]", ref.lstrip("§"))]


def _check_text(text: str, where: str, own: Path | None = None) -> list[str]:
    problems, used, cited = [], set(), set()
    for m in _CHAIN.finditer(text):
        doc = _doc_path(m.group("doc"))
        if not m.group("doc").startswith("docs/") and not doc.is_file():
            continue  # an upper-case word that is not one of our documents
        if not doc.is_file():
            problems.append(f"{where}: {m.group('doc')} does not exist")
            continue
        cited.add(doc)
        heads = _headings(doc)
        for r in _ONE.finditer(m.group("refs")):
            used.add(m.start("refs") + r.start())
            problems += [
                f"{where}: {_rel(doc)} has no section {n} ({r.group(0)})"
                for n in _numbers(r.group(0))
                if n not in heads
            ]
    # a bare § continues the citations of the same file (or points into the document itself)
    scope = cited | ({own} if own else set())
    for r in _ONE.finditer(text):
        if r.start() in used:
            continue
        nums = _numbers(r.group(0))
        if not scope:
            problems.append(f"{where}: {r.group(0)} without a cited document")
        elif not any(all(n in _headings(d) for n in nums) for d in scope):
            names = sorted(_rel(d) for d in scope)
            problems.append(f"{where}: {r.group(0)} is not a section of {names}")
    return problems


def test_section_citations_resolve():
    assert (DOCS / "METHOD.md").is_file() and (DOCS / "ARCHITECTURE.md").is_file()
    problems = []
    for path in _code_files():
        problems += _check_text(path.read_text(), _rel(path))
    for path in _doc_files():
        problems += _check_text(path.read_text(), _rel(path), own=path)
    assert not problems, "\n".join(problems)


def test_the_citation_checker_can_fail():
    assert _check_text("see docs/METHOD.md §4.1, §99", "x")  # no section 99
    assert _check_text("see docs/NOPE.md §1", "x")  # no such document
    assert _check_text("see §3 alone", "x")  # a bare § citing nothing
    assert not _check_text("see docs/METHOD.md §2.6–2.8 and\n# §3.1", "x")


def test_method_sections_are_numbered_for_citation():
    heads = _headings(DOCS / "METHOD.md")
    assert {"4.1", "4.2", "6.2", "6.5", "7.1", "7.2"} <= heads
    assert {"2.11", "3.1", "4.4", "6.4", "7.2"} <= _headings(DOCS / "ARCHITECTURE.md")


# ------------------------------------------------------------------------------------------------
# (c), (d) dotted names and paths in the package's docstrings resolve


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def _comments(src: str) -> list[tuple[int, str]]:
    toks = tokenize.generate_tokens(io.StringIO(src).readline)
    return [(t.start[0], t.string) for t in toks if t.type == tokenize.COMMENT]


def _module_file(parts: list[str]) -> Path | None:
    """dspark_jax/a/b.py or dspark_jax/a/b/__init__.py (a package after a move resolves too)."""
    base = ROOT.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


_TREES: dict[Path, ast.Module] = {}


def _tree(path: Path) -> ast.Module:
    if path not in _TREES:
        _TREES[path] = ast.parse(path.read_text())
    return _TREES[path]


def _bound_names(body) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under `if TYPE_CHECKING` etc.
            names.update(_bound_names(node.body))
    return names


def _class_names(cls: ast.ClassDef) -> set[str]:
    names = set(_bound_names(cls.body))
    for node in ast.walk(cls):  # self.x = ... in any method
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def resolve_dotted(name: str) -> bool:
    """Whether `dspark_jax.a.b(.c)` names a module, a top-level name of one, or an attribute of a
    class defined there. Modules by file, names by `ast`: nothing is imported."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        path = _module_file(parts[:k])
        if path is None:
            continue
        rest = parts[k:]
        if not rest:
            return True
        bound = _bound_names(_tree(path).body)
        if rest[0] not in bound:
            return False
        node = bound[rest[0]]
        if len(rest) == 1 or not isinstance(node, ast.ClassDef):
            return True
        return rest[1] in _class_names(node)
    return False


_DOTTED = re.compile(r"\bdspark_jax(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"\b((?:dspark_jax|benchmarks)/(?:[\w.]+/)*\w+\.py)\b")


def test_dotted_names_in_docstrings_resolve():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        for line, doc in _docstrings(_tree(path)):
            bad += [
                f"{_rel(path)}:{line}: {m.group(0)}"
                for m in _DOTTED.finditer(doc)
                if not resolve_dotted(m.group(0))
            ]
    assert not bad, "names that no longer exist:\n" + "\n".join(bad)


def test_paths_in_docstrings_and_comments_exist():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        src = path.read_text()
        for line, text in _docstrings(_tree(path)) + _comments(src):
            bad += [
                f"{_rel(path)}:{line}: {m.group(1)}"
                for m in _PATH.finditer(text)
                if not (ROOT / m.group(1)).is_file()
            ]
    assert not bad, "paths that no longer exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "name, ok",
    [
        ("dspark_jax.spec.verify", True),
        ("dspark_jax.spec.verify.verify_core", True),
        ("dspark_jax.sched.sts.STS.probs", True),
        ("dspark_jax.engine.engine.ServingEngine.submit", True),
        ("dspark_jax.spec.verify.no_such_function", False),
        ("dspark_jax.no_such_module", False),
        ("dspark_jax.sched.sts.STS.no_such_method", False),
    ],
)
def test_the_name_checker_can_fail(name, ok):
    assert resolve_dotted(name) is ok


# ------------------------------------------------------------------------------------------------
# (e) the package map of docs/ARCHITECTURE.md §2 is the package's file list
#
# Each subsection's heading names the folder(s) its table covers (`models/`, `spec/` and `sched/`,
# `dspark_jax/config/`); the first cell of each row names files: a bare `name.py` lies in the
# heading's one folder, a `sub/name.py` under `dspark_jax/` (the notation of the subsections that
# cover two folders, and of `runtime/` among the leaf modules). Subsections whose heading names
# no folder (§2.1, the repository; §2.12, import direction) are not part of the map.

_MAP_SECTION = re.compile(r"^## 2\.\s.*?(?=^## )", re.M | re.S)
_SUBSECTION = re.compile(r"^### (2\.\d+)\s+(.*)$", re.M)
_FOLDER = re.compile(r"`([\w/]*/)`")
_FILE = re.compile(r"`([\w/]+\.py)`")


def package_map(text: str) -> tuple[list[str], list[str]]:
    """(files named by the package map, relative to dspark_jax/, in order; problems reading it)."""
    section = _MAP_SECTION.search(text)
    if section is None:
        return [], ["no '## 2.' section"]
    body = section.group(0)
    heads = list(_SUBSECTION.finditer(body))
    files, problems = [], []
    for head, nxt in zip(heads, [*heads[1:], None], strict=True):
        folders = [f.removeprefix("dspark_jax/") for f in _FOLDER.findall(head.group(2))]
        if not folders:
            continue
        table = body[head.end() : nxt.start() if nxt else len(body)]
        for row in table.splitlines():
            cells = row.split("|")
            if len(cells) < 3 or set(cells[1].strip()) <= set("-:"):
                continue
            for name in _FILE.findall(cells[1]):
                if "/" in name:
                    files.append(name)
                elif len(folders) == 1:
                    files.append(folders[0] + name)
                else:
                    problems.append(f"§{head.group(1)}: `{name}` needs its folder ({folders})")
    return files, problems


def package_map_problems(text: str) -> list[str]:
    files, problems = package_map(text)
    actual = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")}
    listed = set(files)
    problems += [f"listed twice: {f}" for f in sorted({f for f in files if files.count(f) > 1})]
    problems += [f"listed but no such file: dspark_jax/{f}" for f in sorted(listed - actual)]
    problems += [f"not in the package map: dspark_jax/{f}" for f in sorted(actual - listed)]
    return problems


def test_package_map_lists_every_module_once():
    problems = package_map_problems((DOCS / "ARCHITECTURE.md").read_text())
    assert not problems, "fix docs/ARCHITECTURE.md §2:\n" + "\n".join(problems)


def test_the_package_map_checker_can_fail():
    text = (DOCS / "ARCHITECTURE.md").read_text()
    files, _ = package_map(text)
    assert {"runtime/xla_cpu.py", "models/hf.py", "drafters/hf.py", "cli/serve_engine.py"} <= set(
        files
    )
    row = next(line for line in text.splitlines() if line.startswith("| `eval/decode_cost.py` |"))
    assert "not in the package map: dspark_jax/eval/decode_cost.py" in package_map_problems(
        text.replace(row + "\n", "")
    )
    stale = text.replace(row, row + "\n| `eval/gone.py` | removed |")
    assert "listed but no such file: dspark_jax/eval/gone.py" in package_map_problems(stale)
    twice = text.replace(row, row + "\n" + row)
    assert "listed twice: eval/decode_cost.py" in package_map_problems(twice)
    bare = text.replace("`eval/decode_cost.py`", "`decode_cost.py`")  # §2.11 covers two folders
    assert any("needs its folder" in p for p in package_map_problems(bare))
