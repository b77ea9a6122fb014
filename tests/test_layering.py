"""The package's shape: no import cycles (function-local imports count), no private names imported
across modules, the core never imports the trainer or the server, `pallas_kernels` stands alone, and
no source file is over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle_jax", "pallas_kernels")
MAX_LINES = 500


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages under root."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(name: str, file: Path, modules: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in the file, at any depth
    (function-local imports included), resolved to modules of `modules`."""
    is_pkg = file.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    out.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:  # `from package import submodule`
                    out.append((sub, None, node.lineno))
                elif base in modules:
                    out.append((base, alias.name, node.lineno))
    return out


def violations(root: Path, packages=PACKAGES, core: str = "eagle_jax", apart=("eagle_jax.train", "eagle_jax.serve"),
               standalone: str = "pallas_kernels", max_lines: int = MAX_LINES) -> list[str]:
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    found = []
    for mod, file in modules.items():
        n_lines = len(file.read_text().splitlines())
        if n_lines > max_lines:
            found.append(f"{file.relative_to(root)}: {n_lines} lines (limit {max_lines})")
        in_core = mod.startswith(core) and not any(mod == a or mod.startswith(a + ".") for a in apart)
        for target, name, line in imports(mod, file, modules):
            where = f"{file.relative_to(root)}:{line}"
            if target != mod:
                graph[mod].add(target)
            private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
            if name is not None and name.startswith("_") and not name.startswith("__"):
                private.append(name)
            if private and target != mod:
                found.append(f"{where}: imports private name(s) {private} from {target}")
            if in_core and any(target == a or target.startswith(a + ".") for a in apart):
                found.append(f"{where}: the core module {mod} imports {target}")
            if mod.startswith(standalone) and not target.startswith(standalone):
                found.append(f"{where}: {standalone} imports {target}")
    found += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component of more than one module."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # walk inside the component from its first module back to it
        start, path, seen = comp[0], [comp[0]], {comp[0]}
        while True:
            nxt = sorted(w for w in graph[path[-1]] if w in comp)
            back = start in nxt
            if back:
                out.append(path + [start])
                break
            step = next((w for w in nxt if w not in seen), None)
            if step is None:
                out.append(comp)
                break
            path.append(step)
            seen.add(step)
    return out


def test_the_package_keeps_its_layering_and_file_sizes():
    assert violations(ROOT) == []


def test_the_checker_sees_cycles_private_names_and_layer_breaks(tmp_path):
    files = {
        "eagle_jax/__init__.py": "",
        "eagle_jax/a.py": "from eagle_jax.b import thing\n",
        "eagle_jax/b.py": "def f():\n    from eagle_jax import a  # a function-local import still counts\n",
        "eagle_jax/c.py": "from eagle_jax.b import _hidden\n",
        "eagle_jax/d.py": "def g():\n    import eagle_jax.train.x\n",
        "eagle_jax/train/__init__.py": "",
        "eagle_jax/train/x.py": "from eagle_jax import a\n",
        "pallas_kernels/__init__.py": "from eagle_jax import c\n",
        "pallas_kernels/k.py": "\n" * 501,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = "\n".join(violations(tmp_path))
    assert "import cycle: eagle_jax.a -> eagle_jax.b -> eagle_jax.a" in found
    assert "imports private name(s) ['_hidden'] from eagle_jax.b" in found
    assert "the core module eagle_jax.d imports eagle_jax.train.x" in found
    assert "pallas_kernels imports eagle_jax.c" in found
    assert "pallas_kernels/k.py: 501 lines" in found
    assert "eagle_jax.train.x imports" not in found  # the trainer may use the core


def check_test_tree(tests: Path) -> list[str]:
    """The test tree's own rules: tests sit in the folder of what they test (core/, serve/, train/,
    kernels/, docs/), test modules import shared helpers (builders, doc_commands) and never each other,
    and no two test files share a name (pytest imports them by basename)."""
    found, names = [], {}
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests)
        if len(rel.parts) == 1 and f.name != "test_layering.py":
            found.append(f"{rel}: a test module at the top of tests/ (put it in the folder of what it tests)")
        if f.name in names:
            found.append(f"{rel}: same file name as {names[f.name]}")
        names[f.name] = rel
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m.split(".")[0].startswith("test_") or m.split(".")[0] == "conftest":
                    found.append(f"{rel}:{node.lineno}: imports the test module {m} (shared code goes in builders.py)")
    return found


def test_tests_mirror_the_package_and_share_code_through_builders():
    assert check_test_tree(ROOT / "tests") == []


def test_the_test_tree_checker_fires(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "builders.py").write_text("")
    (tmp_path / "test_loose.py").write_text("")
    (tmp_path / "core" / "test_a.py").write_text("from test_b import x\nimport builders\n")
    (tmp_path / "core" / "test_b.py").write_text("")
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "test_b.py").write_text("def f():\n    import conftest\n")
    found = "\n".join(check_test_tree(tmp_path))
    assert "test_loose.py: a test module at the top" in found
    assert "core/test_a.py:1: imports the test module test_b" in found
    assert "serve/test_b.py: same file name as core/test_b.py" in found
    assert "serve/test_b.py:2: imports the test module conftest" in found
    assert "imports the test module builders" not in found


if __name__ == "__main__":
    problems = violations(ROOT)
    print("\n".join(problems) or "layering OK")
    raise SystemExit(1 if problems else 0)


def test_no_undefined_or_unused_names():
    """pyflakes over the package, the tests and the benchmarks: a name left behind by a refactor fails here,
    not in a slow CLI test."""
    import io

    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    files = [f for d in ("eagle_jax", "pallas_kernels", "tests", "benchmarks") for f in sorted((ROOT / d).rglob("*.py"))]
    problems = sum(checkPath(str(f), Reporter(out, err)) for f in files)
    assert problems == 0, out.getvalue() + err.getvalue()
