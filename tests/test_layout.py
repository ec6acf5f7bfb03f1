"""The layout the docs promise: a top level of at most 12 modules, folders that say what they hold, files and
functions short enough to read, and imports that point one way between packages (no cycle)."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from reading_walk import named_range, path_size

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("nanogrpo", "rewards", "nanogrpo_kernels", "nanogrpo_base")
MAX_FILE_LINES = 460  # "about 450"
ONE_CONCEPT = {"nanogrpo/grpo.py": 520}  # the loss with its KL terms: one concept the cap would split
MAX_FUNCTION_LINES = 80


def tracked(*tops: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [
        f for f in out.stdout.split() if f.split("/")[0] in tops or (len(f.split("/")) == 1 and "." in tops)
    ]
    return [ROOT / f for f in files if (ROOT / f).exists()]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def node(module: str, modules: dict[str, Path]) -> str:
    """A module's place in the package graph: its package, except that nanogrpo's top-level modules are each
    a node of their own (config, data, grpo, ... are the core the packages around them build on)."""
    package = module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    return module if package == "nanogrpo" else package


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in tracked(*LIBRARY)}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                targets = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and node(t, modules) != node(name, modules):
                    edges.setdefault(node(name, modules), set()).add(node(t, modules))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_top_level_has_at_most_12_modules():
    top = sorted(p.name for p in (ROOT / "nanogrpo").glob("*.py"))
    assert len(top) <= 12, top


def project_modules_imported(path: Path) -> set[str]:
    """The project modules a file imports (nanogrpo, rewards, nanogrpo_kernels, nanogrpo_base and their
    modules; `from pkg import mod` counts the module), imports inside functions included."""
    modules = {module_name(p) for p in tracked(*LIBRARY)}
    found = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names if a.name in modules}
        elif (
            isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and n.module.split(".")[0] in LIBRARY
        ):
            subs = {f"{n.module}.{a.name}" for a in n.names} & modules
            found |= subs | ({n.module} if len(subs) < len(n.names) else set())
    return found


def test_train_py_reads_the_step_first():
    """train.py: the loop, then grpo_step within its first 150 lines, and at most 15 project modules."""
    tree = ast.parse((ROOT / "train.py").read_text())
    step = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "grpo_step")
    assert step.lineno <= 150, step.lineno
    imported = project_modules_imported(ROOT / "train.py")
    assert len(imported) <= 15, sorted(imported)


def test_the_reading_path_is_todays_code():
    """docs/reading-path.txt (the step's reading path that docs/ARCHITECTURE.md counts) gives each stage by name
    (`# stage = file:name, ...`) and as the line ranges a counter reads (the next line): the ranges must be
    the names' on today's code, so the count in the docs is of the code as it is."""
    lines = (ROOT / "docs" / "reading-path.txt").read_text().splitlines()
    stale = []
    for k, line in enumerate(lines):
        if line.startswith("# ") and " = " in line:
            stage, names = line[2:].split(" = ", 1)
            want = f"{stage}: " + ", ".join(named_range(ROOT, item) for item in names.split(","))
            if lines[k + 1] != want:
                stale.append(want)
    assert sum(1 for x in lines if x.startswith("# ") and " = " in x) >= 10, "every stage, by name"
    assert stale == [], "the code moved; in docs/reading-path.txt, replace these lines:\n" + "\n".join(stale)


def test_the_reading_path_reads_in_an_afternoon():
    """One GRPO step of the demo, as docs/reading-path.txt lists it (docs/ARCHITECTURE.md, "Reading one step"):
    at most 1,800 lines in at most 17 files."""
    lines, files = path_size()
    assert lines <= 1800 and files <= 17, (lines, files)


def test_each_folder_says_what_it_holds():
    for init in tracked(*LIBRARY):
        if init.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and doc.strip(), (
                f"{init.relative_to(ROOT)} has no docstring saying what the folder holds"
            )


def test_no_library_file_is_long():
    long = {}
    for p in tracked(*LIBRARY, "."):
        n = len(p.read_text().splitlines())
        if n > ONE_CONCEPT.get(str(p.relative_to(ROOT)), MAX_FILE_LINES):
            long[str(p.relative_to(ROOT))] = n
    assert long == {}, f"split these by concept: {long}"


def test_no_function_is_long():
    long = {}
    for p in tracked(*LIBRARY, "tests", "scripts", "."):
        for n in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.end_lineno - n.lineno >= MAX_FUNCTION_LINES
            ):
                long[f"{p.relative_to(ROOT)}:{n.name}"] = n.end_lineno - n.lineno + 1
    assert long == {}, long


def test_imports_between_packages_have_no_cycle():
    assert cycles(package_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def imported_test_modules(source: str) -> list[str]:
    """The test_* modules a file's source imports, at module level or inside a function."""
    found = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            found |= {n.module} if n.module else {a.name for a in n.names}  # `from . import test_x`
    return sorted(m for m in found if m.split(".")[0].startswith("test_"))


def test_no_test_module_imports_another():
    """A test module imports its helpers from tests/helpers.py and gets its fixtures from tests/conftest.py:
    importing another test module runs that module's set-up and ties the two files together (the modules
    that only hold helpers, such as tests/golden_runs.py, may still be imported)."""
    tests = ROOT / "tests"
    found = {
        str(p.relative_to(ROOT)): mods
        for p in [*sorted(tests.glob("test_*.py")), tests / "conftest.py"]
        if (mods := imported_test_modules(p.read_text()))
    }
    assert found == {}, (
        f"move what these files import into tests/helpers.py (fixtures: tests/conftest.py): {found}"
    )


def test_the_import_finder_sees_imports_inside_functions():
    source = (
        "import os\nfrom helpers import ROOT\nfrom test_a import x\nimport golden_runs, test_b.c as b\n"
        "def f():\n    from test_d import y\n    from . import test_e\n"
    )
    assert imported_test_modules(source) == ["test_a", "test_b.c", "test_d", "test_e"]


def installed_names() -> list[str]:
    """The top-level import names `pip install nanogrpo` puts in site-packages: the packages and the two
    entry points' modules, read from pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [pattern.removesuffix("*") for pattern in setup["packages"]["find"]["include"]]
    return packages + setup["py-modules"]


def test_no_installed_name_is_another_distributions():
    """A top-level name of ours that another installed distribution also ships shadows it, and breaks whatever
    imports it: transformers 5.25 depends on Hugging Face's `kernels` and imports it at start-up, which found
    our old top-level `kernels/` folder instead and failed."""
    names = installed_names()
    assert sorted(names) == sorted([*LIBRARY, "train", "eval"])
    owners = importlib.metadata.packages_distributions()
    taken = {name: others for name in names if (others := set(owners.get(name, [])) - {"nanogrpo"})}
    assert taken == {}, f"rename these packages: another installed distribution ships them: {taken}"


def test_no_script_shadows_an_installed_module():
    """`python bench/x.py` puts bench/ first on sys.path (pytest puts tests/ there), so a file beside a script
    named like an installed module is imported in its place: bench/kernels.py once stood in for Hugging Face's
    `kernels` inside transformers."""
    owners = importlib.metadata.packages_distributions()
    shadows = {
        str(p.relative_to(ROOT)): owners.get(p.stem, "the standard library")
        for p in tracked("bench", "scripts", "tests", ".")
        if p.parent.relative_to(ROOT).as_posix() in ("bench", "scripts", "tests", ".")
        and (set(owners.get(p.stem, [])) - {"nanogrpo"} or p.stem in sys.stdlib_module_names)
    }
    assert shadows == {}, f"rename these files: each hides the installed module of its name: {shadows}"


def test_a_taken_name_is_found():
    """The check above sees a name that an installed distribution ships: `torch` is torch's."""
    assert "torch" in importlib.metadata.packages_distributions()["torch"]
