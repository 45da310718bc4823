"""House rules of the source tree, read with `ast` and `tokenize` (no jax, well under a second):

* at most `MAX_LOCAL_IMPORTS` function-local imports in dspark_jax/, each with its reason in a
  comment on its line or the line above (a heavy import the CLIs' start must not pay, an optional
  dependency, a module that must not load jax before the configuration is checked);
* no edit of the import path (`sys` `path`) in any Python file of the repository (run scripts
  with `python -m`, give subprocesses `cwd=` / `PYTHONPATH`);
* configuration in one package: no `*config*.py` module at dspark_jax's top level;
* the environment read only by `dspark_jax.runtime` (its __init__.py);
* no import cycle among dspark_jax's modules, counting the imports inside functions too: a local
  import must not hide a cycle (move the code instead).
"""

from __future__ import annotations

import ast
import collections
import io
import os
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dspark_jax"
MAX_LOCAL_IMPORTS = 40
# the one module that reads (and sets) the process's environment
ENVIRON_READERS = ("dspark_jax/runtime/__init__.py",)
# other files allowed to touch os.environ, each with its reason (none)
ENVIRON_EXCEPTIONS: dict[str, str] = {}
SKIP_DIRS = {".git", ".venv", "venv", ".tox", ".eggs", "build", "dist", "node_modules",
             "__pycache__", ".pytest_cache", ".ruff_cache", "site-packages"}  # fmt: skip
PRAGMA = re.compile(r"^(noqa\b.*|type:.*|fmt:.*|pragma\b.*|pylint:.*)$")


def _python_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not (here / d / "pyvenv.cfg").exists())  # fmt: skip
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield here / f


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _module_name(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _comments(src: str) -> dict[int, str]:
    """line -> comment text, pragmas (noqa, type:, fmt:) left out."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            parts = [s.strip() for s in tok.string.lstrip("#").split("#")]
            text = " ".join(s for s in parts if s and not PRAGMA.match(s))
            if text:
                out[tok.start[0]] = text
    return out


def _imports(tree: ast.AST):
    """(import node, inside a function) for every import statement of a module."""
    out = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, local))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return out


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _python_files(PACKAGE)}


def local_imports() -> list[tuple[str, int, str]]:
    """(file, line, reason or "") of every function-local import in dspark_jax/."""
    out = []
    for p in _python_files(PACKAGE):
        src = p.read_text()
        notes = _comments(src)
        for node, local in _imports(ast.parse(src)):
            if local:
                lines = range(node.lineno - 1, node.end_lineno + 1)
                reason = " ".join(notes[i] for i in lines if i in notes)
                out.append((_rel(p), node.lineno, reason))
    return out


def test_few_local_imports_each_with_its_reason():
    found = local_imports()
    assert len(found) <= MAX_LOCAL_IMPORTS, (
        f"{len(found)} function-local imports in dspark_jax/ (at most {MAX_LOCAL_IMPORTS}): "
        "import at the top unless a measured reason holds\n"
        + "\n".join(f"  {f}:{n}" for f, n, _ in found)
    )
    bare = [f"{f}:{n}" for f, n, reason in found if not reason]
    assert not bare, (
        "function-local imports without their reason in a comment (same line or the line above; "
        "e.g. `# heavy: 1.2 s to import (python -X importtime)`, `# optional dependency`): "
        + ", ".join(bare)
    )


SYS_PATH_EDIT = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend|remove)\b|\[|\+?=)")


def import_path_uses(p: Path) -> list[int]:
    """Lines of `p` that use the interpreter's import path (`sys` `path`) in code or an import, or edit it in a string (code given
    to `python -c`, a script written by a test); comments and prose do not count."""
    tree = ast.parse(p.read_text())
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):  # fmt: skip
            lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            if any(a.name == "path" for a in node.names):
                lines.add(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if SYS_PATH_EDIT.search(node.value):
                lines.add(node.lineno)
    return sorted(lines)


def test_the_import_path_is_never_edited():
    uses = [f"{_rel(p)}:{line}" for p in _python_files(ROOT) for line in import_path_uses(p)]
    assert not uses, (
        "the import path edited (run the script with `python -m`, give a subprocess cwd= or "
        f"PYTHONPATH): {', '.join(uses)}"
    )


def test_configuration_is_one_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if "config" in p.stem)
    assert not top, f"configuration modules at dspark_jax's top level: {top} (dspark_jax/config/)"
    assert (PACKAGE / "config" / "__init__.py").is_file()


def environ_uses(p: Path) -> list[int]:
    """Lines of `p` that read or set the process's environment (os.environ, os.getenv, ...)."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    lines = []
    for node in ast.walk(ast.parse(p.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in names
                and isinstance(node.value, ast.Name) and node.value.id == "os"):  # fmt: skip
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in names for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_environment_read_by_the_runtime_module_only():
    readers = []
    for p in _python_files(PACKAGE):
        rel = _rel(p)
        if rel.startswith(ENVIRON_READERS) or rel in ENVIRON_EXCEPTIONS:
            continue
        readers += [f"{rel}:{line}" for line in environ_uses(p)]
    assert not readers, (
        "the environment is read outside dspark_jax/runtime/__init__.py (add a field to "
        f"runtime.Settings, or a function there): {', '.join(readers)}"
    )


def import_graph() -> dict[tuple[str, str], list[tuple[str, int]]]:
    """(importer, imported) -> [(file:line, "top" / "local")] among dspark_jax's modules. An
    import names the module it loads (`from dspark_jax.a import b` loads dspark_jax.a.b when b
    is a module, else dspark_jax.a); a package's own __init__ is not counted as imported by its
    submodules' imports of their siblings (Python has it in sys.modules by then)."""
    mods = _package_modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = collections.defaultdict(list)
    for mod, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node, local in _imports(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]  # fmt: skip
            for t in targets:
                target = known(t) if t.split(".")[0] == "dspark_jax" else None
                if target and target != mod:
                    where = f"{_rel(p)}:{node.lineno}"
                    edges[(mod, target)].append((where, "local" if local else "top"))
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of the graph as [m0, m1, ..., m0], or None."""
    adj = collections.defaultdict(list)
    for a, b in sorted(edges):
        adj[a].append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in adj[v]:
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(adj):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_no_import_cycle_hidden_by_a_local_import():
    edges = import_graph()
    cycle = find_cycle(edges)
    if cycle:
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            where, kind = edges[(a, b)][0]
            steps.append(f"  {a} -> {b}  ({kind} import, {where})")
        raise AssertionError(
            "import cycle among dspark_jax's modules (a local import does not remove it: move "
            "the code the two modules share):\n" + "\n".join(steps)
        )
