"""The reading path as a --plain step runs it: every Python call of one `python train.py demo --plain` step
(the tiny model in SmolLM2's place, so it takes seconds), traced, and held against docs/reading-path.txt.

    python tests/reading_walk.py        # the walk: each stay a line, the returns counted

- `ran`: which of the path's definitions ran (a class: any of its methods, or its body);
- `fast`: which functions of the fast paths ran (none may, under --plain);
- the walk: the path's definitions in the order of their first call; a *stay* is a run of consecutive ones
  in one file, a *return* a stay in a file the walk has already left (docs/ARCHITECTURE.md, "Reading one
  step", records the count).
"""

from __future__ import annotations

import ast
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what --plain must never run: the fast paths, the attention kernels, the log-prob kernels (nanogrpo_kernels'
# lcs.py is ROUGE-L's LCS, a grader's: rapidfuzz on the CPU, whatever the path)
FAST = ("nanogrpo/model/fast/", "nanogrpo/model/attention.py", "nanogrpo_kernels/logprobs")
DEMO = ["demo", "--model.path", "tiny", "--model.dtype", "float32", "--steps", "1", "--eval-prompts", "0",
        "--no-plots", "--prompts-per-step", "2", "--plain"]  # fmt: skip


def definitions(path: Path) -> dict[str, tuple[int, int]]:
    """{name: (first line, last line)} of a file's top-level defs, classes and assignments and of its classes'
    methods ('Class.method'); a decorator's line is the first."""
    tree, out = ast.parse(path.read_text()), {}
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            target = n.targets[0] if isinstance(n, ast.Assign) else n.target
            out[ast.unparse(target)] = (n.lineno, n.end_lineno)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            members = [(n.name, n)]
            if isinstance(n, ast.ClassDef):
                members += [(f"{n.name}.{m.name}", m) for m in n.body if isinstance(m, ast.FunctionDef)]
            for name, m in members:
                out[name] = (min([m.lineno, *(d.lineno for d in m.decorator_list)]), m.end_lineno)
    return out


def named_range(root: Path, item: str) -> str:
    """'file:name' (or 'file:Class.method', or 'file:A..B': A's first line to B's last, B a method of A's
    class when it has no dot) -> 'file:first-last' on today's code."""
    f, name = item.strip().split(":")
    defs = definitions(root / f)
    a, _, b = name.partition("..")
    if b and b not in defs:
        b = f"{a.split('.')[0]}.{b}"
    gone = [x for x in (a, b) if x and x not in defs]
    assert not gone, (
        f"docs/reading-path.txt names {gone} in {f}, which no longer defines them: name what the step runs now"
    )
    return f"{f}:{defs[a][0]}-{defs[b or a][1]}"


def path_definitions() -> list[tuple[str, str, int, int]]:
    """(stage, 'file:name', first line, last line) of every definition docs/reading-path.txt names."""
    out = []
    for line in (ROOT / "docs" / "reading-path.txt").read_text().splitlines():
        if line.startswith("# ") and " = " in line:
            stage, names = line[2:].split(" = ", 1)
            for item in names.split(","):
                f, span = named_range(ROOT, item).split(":")
                a, b = span.split("-")
                out.append((stage, item.strip(), int(a), int(b)))
    return out


def path_size() -> tuple[int, int]:
    """(lines, files) of docs/reading-path.txt's definitions: every line of them, a line listed twice once."""
    seen: dict[str, set[int]] = {}
    for _, name, a, b in path_definitions():
        seen.setdefault(name.split(":")[0], set()).update(range(a, b + 1))
    return sum(map(len, seen.values())), len(seen)


def holds_code(f: str, a: int, b: int) -> bool:
    """Whether lines a..b of file f hold a function (a dataclass of fields, such as a config, or an assignment,
    holds none: nothing of it is called, it is read)."""
    tree = ast.parse((ROOT / f).read_text())
    return any(isinstance(n, ast.FunctionDef) and a <= n.lineno <= b for n in ast.walk(tree))


def trace(args: list[str]) -> list[tuple[str, str, int]]:
    """('call' or 'return', file relative to the root, first line of the code object) of every Python call
    and return of `train.run(args)`, in order (of code outside the repository: file '')."""
    sys.path.insert(0, str(ROOT))
    import train

    calls: list[tuple[str, str, int]] = []
    root = str(ROOT) + "/"

    def profile(frame, event, arg):
        if event in ("call", "return"):
            f = frame.f_code.co_filename
            f = f[len(root) :] if f.startswith(root) else ""
            calls.append((event, f, frame.f_code.co_firstlineno))

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            rc = train.run([*args, "--out-dir", out])
        finally:
            sys.setprofile(None)
    assert rc == 0, f"train.py {' '.join(args)} failed"
    return calls


def walk(calls: list[tuple[str, str, int]]) -> dict:
    """The path against the traced calls: what ran, the fast paths that ran, and the walk.

    The walk is a reader's: into each of the path's definitions at its first call, and back to its caller
    when it returns (a later call of a definition already read moves the reader nowhere). A stay is a run of
    the walk in one file; a return, a stay in a file the walk has already left."""
    defs = path_definitions()
    fast = sorted({f"{f}:{line}" for e, f, line in calls if e == "call" and f.startswith(FAST)})
    read: list[str] = []  # the path's definitions by first call
    moves: list[tuple[str, str]] = []  # (file, definition) the reader is at, as the walk goes
    stack: list[tuple[str | None, bool]] = []  # per frame: its path definition (None: off the path), first?
    for event, f, line in calls:
        if event == "call":
            hits = [(b - a, name) for _, name, a, b in defs if name.split(":")[0] == f and a <= line <= b]
            name = min(hits)[1] if hits else None  # the innermost: a method listed apart from its class
            first = name is not None and name not in read
            if first:
                read.append(name)
                moves.append((f, name))
            stack.append((name, first))
        elif stack:
            name, first = stack.pop()
            back = next((n for n, _ in reversed(stack) if n is not None), None)
            if first and back is not None:
                moves.append((back.split(":")[0], back))
    stays: list[tuple[str, list[str], bool]] = []
    seen: set[str] = set()
    for f, name in moves:
        if not stays or stays[-1][0] != f:
            stays.append((f, [], f in seen))
            seen.add(f)
        if name.split(":")[1] not in stays[-1][1]:
            stays[-1][1].append(name.split(":")[1])
    returns = sum(r for _, _, r in stays)
    never = [name for _, name, a, b in defs if name not in read and holds_code(name.split(":")[0], a, b)]
    return {"order": read, "stays": stays, "returns": returns, "never": never, "fast": fast}


if __name__ == "__main__":
    lines, files = path_size()
    print(f"the reading path: {lines} lines in {files} files")
    w = walk(trace(DEMO))
    for f, names, back in w["stays"]:
        print(f"{'<-' if back else '  '} {f}: {', '.join(names)}")
    print(f"{len(w['stays'])} stays, {w['returns']} of them returns; never ran: {w['never'] or 'none'}; "
          f"fast paths that ran: {w['fast'] or 'none'}")  # fmt: skip
