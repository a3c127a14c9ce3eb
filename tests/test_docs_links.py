"""Every relative link of the documentation leads somewhere: the file exists and, for a
Markdown file, so does the heading the anchor names (GitHub's anchors)."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The file without code blocks and code spans (their brackets are not links)."""
    return _CODE.sub("", _FENCE.sub("", path.read_text()))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(path))
            if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: lead elsewhere


def test_the_slug_rule_is_githubs() -> None:
    page = ROOT / "docs" / "PAPERS.md"
    assert "1-lucid-individual-differential-privacy-for-label-only-answers" in anchors(page)
    assert "what-make-demo-does" in anchors(ROOT / "docs" / "development.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_the_readme_is_one_screen_that_leads_to_the_docs() -> None:
    """At most 70 lines: the make commands first, then a quick start whose every command
    the Makefile or `obliviate`'s parser takes, then one line for each file of docs/."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 70, f"README.md: {len(lines)} lines (one screen: at most 70)"
    head = "\n".join(lines[:10])
    for target in ("make demo", "make test", "make test-fast"):
        assert re.search(rf"^{target}\b", head, re.M), f"README.md: no '{target}' on top"
    assert text.index("make demo") < text.index("## Quick start") < text.index(
        "## Where to go next")
    named = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = {Path(t.partition("#")[0]).name for t in relative_links(ROOT / "README.md")
              if t.startswith("docs/")}
    assert named <= linked, f"README.md: no line for docs/{sorted(named - linked)}"


def _shell_lines(path: Path) -> list[str]:
    """The commands of a file's `sh` blocks: comments dropped, continued lines joined."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", path.read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def test_the_readmes_commands_exist() -> None:
    """Every `make` target the README names is one of the Makefile's, and every
    `obliviate` command it shows parses (argparse exits on an unknown command or flag)."""
    from service.cli import build_parser

    makefile = (ROOT / "Makefile").read_text()
    commands = _shell_lines(ROOT / "README.md")
    makes = [c.split()[1] for c in commands if c.startswith("make ")]
    obliviates = [c for c in commands if c.startswith("obliviate ")]
    assert {"demo", "test", "test-fast", "install"} <= set(makes)
    assert len(obliviates) >= 5
    for target in makes:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}"
    for command in obliviates:
        argv = shlex.split(command.removesuffix("&").strip())[1:]
        try:
            build_parser().parse_args(argv)
        except (SystemExit, argparse.ArgumentError) as e:
            pytest.fail(f"README.md: `{command}` does not parse: {e}")


_MODULES = sorted(p for package in ("ledger", "jobs", "service")
                  for p in (ROOT / package).rglob("*.py"))
_DOC_REF = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?(?: \(([^)]+)\))?")


def _headings(path: Path) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$",
                                            _FENCE.sub("", path.read_text()), re.M)]


@pytest.mark.parametrize("module", [p.relative_to(ROOT).as_posix() for p in _MODULES])
def test_module_docstrings_are_short_and_point_to_the_docs(module: str) -> None:
    """What and why in at most 8 lines, then "See docs/<file>.md (section)." naming a file
    of docs/ and, in brackets, the start of one of its headings (or its anchor after "#").
    Migration revisions may do without the link (their docstring is Alembic's)."""
    doc = ast.get_docstring(ast.parse((ROOT / module).read_text()), clean=False)
    assert doc and doc.strip(), f"{module}: no module docstring"
    lines = doc.strip().splitlines()
    assert len(lines) <= 8, f"{module}: module docstring of {len(lines)} lines (at most 8)"
    refs = _DOC_REF.findall(doc)
    if "/migrations/versions/" not in module:
        assert refs, f"{module}: the module docstring names no docs/ file"
    for name, anchor, section in refs:
        target = ROOT / "docs" / name
        assert target.exists(), f"{module}: docs/{name} does not exist"
        if anchor:
            assert anchor in anchors(target), f"{module}: no heading '#{anchor}' in {name}"
        if section:
            assert any(h.startswith(section) for h in _headings(target)), (
                f"{module}: docs/{name} has no heading '{section}'")
