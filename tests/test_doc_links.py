"""The docs' links resolve: in README.md, docs/*.md and bench/README.md every relative link `[text](path)`,
`[text](path#anchor)`, `[text](#anchor)` and image points at a file or folder that exists, and an anchor
into a markdown file names one of its headings (GitHub's slugs: lowercase, punctuation other than `-` and
`_` dropped, each space a hyphen, a repeated heading suffixed -1, -2, ...). Links to http(s) and mailto,
and anything inside code (fenced blocks and `inline` spans), are not checked. README.md stays a first
hour's read: at most 160 lines."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 160

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
LINK = re.compile(  # [text](target "title") or ![alt](target); the text may hold one level of [brackets]
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"  # [text]
    r"\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?"  # (target, with balanced parentheses
    r"(?:\s+[\"'(].*?[\"')])?\s*\)"  # and an optional title)
)
REF_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']", re.IGNORECASE)
SKIPPED_SCHEMES = ("http://", "https://", "mailto:")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if (ROOT / "bench" / "README.md").exists():
        files.append(ROOT / "bench" / "README.md")
    return files


def prose_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, the line with its inline code spans blanked out) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if (
                m
                and m.group(1)[0] == fence[0]
                and len(m.group(1)) >= len(fence)
                and not line.strip(fence[0] + " ")
            ):
                fence = None
            continue
        out.append((number, line, INLINE_CODE.sub(lambda c: " " * len(c.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: the text as rendered (code spans, link targets, images and
    HTML tags gone), lowercased, every character but letters, digits, spaces, `-` and `_` dropped, and
    each space a hyphen."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes for the markdown file: its headings' slugs (a repeated one suffixed
    -1, -2, ... in order) and the names of its `<a name=...>` / `<a id=...>` tags."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line, prose in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(prose))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2) or "")
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code, reference definitions included."""
    out = []
    for number, _, prose in prose_lines(path.read_text(encoding="utf-8")):
        out += [(number, m.group(2)) for m in LINK.finditer(prose)]
        d = REF_DEFINITION.match(prose)
        if d:
            out.append((number, d.group(1)))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: target (why)' for each link of `path` that does not resolve."""
    root, path = root.resolve(), path.resolve()
    broken = []
    for number, target in links(path):
        if target.lower().startswith(SKIPPED_SCHEMES):
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if not file_part:
            dest = path
        elif file_part.startswith("/"):
            dest = root / file_part.lstrip("/")
        else:
            dest = (path.parent / file_part).resolve()
        shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
        if not file_part and not anchor:
            broken.append(f"{where} (an empty link)")
        elif not dest.exists():
            broken.append(f"{where} (no such file: {shown})")
        elif anchor and dest.suffix.lower() == ".md" and unquote(anchor).lower() not in anchors(dest):
            broken.append(f"{where} (no heading of {shown} has the anchor #{anchor})")
    return broken


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_readme_is_a_first_hours_read():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines; move the detail to docs/ (at most {README_MAX_LINES})"
    )


def test_slugs_follow_github():
    assert slug("Combining graders") == "combining-graders"
    assert slug("SFT (`--algo sft`)") == "sft---algo-sft"
    assert slug("Evaluate: is the trained model better, and is it significant?") == (
        "evaluate-is-the-trained-model-better-and-is-it-significant"
    )
    assert slug("CPT: continued pre-training (`--algo cpt`)") == "cpt-continued-pre-training---algo-cpt"
    assert slug("The seed papers' pipelines") == "the-seed-papers-pipelines"
    assert slug("memory_plan.py and [the plan](docs/SCALING.md)") == "memory_planpy-and-the-plan"
    assert slug("2026-12-02, evening: the three CPU targets") == "2026-12-02-evening-the-three-cpu-targets"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "B.md").write_text("# Title\n\n## Same\n\n## Same\n\n### Also `code` here\n")
    a = tmp_path / "A.md"
    a.write_text(
        "# A\n\n"
        "[ok](docs/B.md) [ok](docs/B.md#title) [ok](docs/B.md#same-1) [ok](docs/B.md#also-code-here)\n"
        "[ok](#a) [ok](https://example.com/none) [ok](mailto:x@example.com) ![ok](docs/B.md)\n"
        "`[code](missing.md)`\n\n"
        "```\n[code](missing.md)\n```\n\n"
        "[gone](docs/C.md) [bad anchor](docs/B.md#same-2) [bad self](#nowhere) ![gone](img/x.png)\n"
        "[ref]: docs/D.md\n"
    )
    found = broken_links(a, tmp_path)
    assert [f.split(" (")[0] for f in found] == [
        "A.md:11: docs/C.md",
        "A.md:11: docs/B.md#same-2",
        "A.md:11: #nowhere",
        "A.md:11: img/x.png",
        "A.md:12: docs/D.md",
    ], found
