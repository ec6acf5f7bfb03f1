"""The layering docs/ARCHITECTURE.md states: rewards/ is a leaf package (it imports nothing of nanogrpo, at
module level or inside a function); nanogrpo_base/, the machinery under both, imports neither; nanogrpo's
infra/, envs/ and model/ import no grader internals (the judge backend's injection point aside)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import rewards

ROOT = Path(__file__).resolve().parents[1]

# a fresh interpreter where `import nanogrpo` (and nanogrpo.*) fails: every module of rewards/ imports,
# and the graders' agreement report (which once took its statistics from nanogrpo.eval.stats) runs
BLOCKED = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class NoNanogrpo:
        def find_spec(self, name, path=None, target=None):
            if name == "nanogrpo" or name.startswith("nanogrpo."):
                raise ImportError(f"rewards imported {name}")
            return None

    sys.meta_path.insert(0, NoNanogrpo())
    import rewards

    names = [m.name for m in pkgutil.walk_packages(rewards.__path__, "rewards.")]
    for name in names:
        importlib.import_module(name)
    from rewards.grade import agreement

    rows = [{"id": i, "_line": i + 1, "human": h, "completion": "x"} for i, h in enumerate([1, 2, 3])]
    agree = agreement(rows, [0.1, 0.5, 0.9], ["g", "g", "g"], top=1)
    assert agree["kendall_tau"] == 1.0 and agree["pairwise_accuracy"] == 1.0, agree
    assert not [m for m in sys.modules if m == "nanogrpo" or m.startswith("nanogrpo.")]
    print(len(names))
    """
)


def rewards_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(rewards.__path__, "rewards.")]


def test_every_rewards_module_imports_without_nanogrpo():
    res = subprocess.run(
        [sys.executable, "-c", BLOCKED], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) == len(rewards_modules()) > 10


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.lineno, node.module or ""))
    return out


def imports_of(folders: list[str], packages: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    """'file:line: module' for each import of `packages` (or their modules) in the files under `folders`."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in allowed:
                continue
            bad = [(n, m) for n, m in imports(path) if m.split(".")[0] in packages]
            found += [f"{name}:{n}: imports {m}" for n, m in bad]
    return found


def test_no_rewards_source_names_nanogrpo_in_an_import():
    """Also the imports inside functions, which importing a module does not run."""
    assert imports_of(["rewards"], ("nanogrpo",)) == []


def test_the_base_imports_neither_nanogrpo_nor_rewards():
    """nanogrpo_base/ lies under both packages: the machinery they share (flag ranges, reading rows, writing
    files, time limits) must not reach back up into either, in its source or when imported."""
    assert imports_of(["nanogrpo_base"], ("nanogrpo", "rewards")) == []
    blocked = textwrap.dedent(
        """
        import importlib, pkgutil, sys

        class Neither:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nanogrpo", "rewards"):
                    raise ImportError(f"nanogrpo_base imported {name}")

        sys.meta_path.insert(0, Neither())
        import nanogrpo_base

        names = [m.name for m in pkgutil.walk_packages(nanogrpo_base.__path__, "nanogrpo_base.")]
        for name in names:
            importlib.import_module(name)
        print(len(names))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) >= 4


def test_infra_envs_and_model_import_no_grader_internals():
    """What a run is built on (infra/, envs/, model/) takes the machinery it shares with the graders from
    nanogrpo_base; nanogrpo/judge_backend.py, the judge backend's injection point, imports rewards beside them."""
    folders = ["nanogrpo/infra", "nanogrpo/envs", "nanogrpo/model"]
    assert imports_of(folders, ("rewards",)) == []
    found = [m for _, m in imports(ROOT / "nanogrpo" / "judge_backend.py") if m.split(".")[0] == "rewards"]
    assert found, "the injection point is found"


def test_an_import_inside_a_function_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import os\n\ndef f():\n    from rewards.rows import read_rows\n")
    assert imports_of(["pkg"], ("rewards",)) == ["pkg/m.py:4: imports rewards.rows"]
