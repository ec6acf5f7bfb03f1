"""rewards/ is a leaf package: it imports nothing of nanogrpo, at module level or inside a function."""

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


def test_no_rewards_source_names_nanogrpo_in_an_import():
    """Also the imports inside functions, which importing a module does not run."""
    found = []
    for path in sorted(Path(rewards.__path__[0]).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            bad = [m for m in mods if m == "nanogrpo" or m.startswith("nanogrpo.")]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in bad]
    assert not found, found
