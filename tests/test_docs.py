"""The design docs live in docs/ and every citation of them resolves (CPU only, no extras).

  - every `<name>.md` that code, tests or README.md mention is a file of this repository (a path
    from the repository root, or from the citing file's own folder);
  - every "<doc>.md section N" (also "sections 4, 5", "sec. 3", "§ 2", "<doc>.md 2.4", "3.2-3.3",
    "principle 4") names a heading that exists in docs/<doc>.md: `## N.` for a section, `### N.M`
    for a subsection, a numbered item `N.` under "## Principles" for a principle;
  - docs/README.md indexes every page of docs/;
  - no file of the repository points outside it to the old design-doc folder.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_NAMES = ("architecture", "interfaces", "kimi-k2", "ddtree", "hardware-and-kernels", "tensorrt-rtx", "style",
             "usage", "performance", "tiny-model")

# a mention of a markdown file: a path-like word ending in .md (not preceded by another path character)
MD_MENTION = re.compile(r"(?<![\w./-])([\w./-]*\w\.md)\b")
# a citation of one of our docs, then optionally a section keyword, then numbers: "5", "2.1-2.2, 4.1", "3 and 4"
NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(
    r"(?<![\w./-])(?:docs/)?(?P<doc>" + "|".join(re.escape(n) for n in DOC_NAMES) + r")\.md\)?"
    r"(?: (?P<kw>sections?|sec\.|§|principle))? ?"
    r"(?P<nums>" + NUM + r"(?:(?:, | and |-)" + NUM + r"(?![\w-]))*)(?![\w-])")


def code_files() -> list[Path]:
    """The files whose doc citations must resolve: ddtree/ sources and kernels, tests/, README.md."""
    files = [ROOT / "README.md"]
    for pattern in ("*.py", "*.cu", "*.cuh"):
        files += sorted((ROOT / "ddtree").rglob(pattern))
    files += sorted((ROOT / "tests").rglob("*.py"))
    this = Path(__file__).resolve()                    # its own strings are parser test data
    return [f for f in files if "__pycache__" not in f.parts and f != this]


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def mentions(path: Path) -> list[tuple[int, str]]:
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        out += [(lineno, m.group(1)) for m in MD_MENTION.finditer(line)]
    return out


def citations_in(text: str) -> list[tuple[int, str, str, list[str]]]:
    """(line, doc, keyword, [section numbers]) for each numbered citation of one of our docs."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            out.append((lineno, m.group("doc"), m.group("kw") or "", re.findall(NUM, m.group("nums"))))
    return out


def citations(path: Path) -> list[tuple[int, str, str, list[str]]]:
    return citations_in(path.read_text(encoding="utf-8"))


def headings(doc: str) -> set[str]:
    """Section numbers with headings in docs/<doc>.md: "5" for '## 5. ...', "2.1" for '### 2.1 ...'."""
    found = set()
    for line in (DOCS / f"{doc}.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"(#{2,4}) (" + NUM + r")\.? ", line)
        if m and len(m.group(1)) == m.group(2).count(".") + 2:
            found.add(m.group(2))
    return found


def principles(doc: str) -> set[str]:
    """Numbers of the items of the '## Principles' list of docs/<doc>.md."""
    text = (DOCS / f"{doc}.md").read_text(encoding="utf-8")
    part = text.split("\n## Principles", 1)
    if len(part) < 2:
        return set()
    body = part[1].split("\n## ", 1)[0]
    return set(re.findall(r"^(\d+)\. ", body, re.M))


def test_every_design_doc_exists():
    missing = [f"docs/{n}.md" for n in DOC_NAMES + ("README",) if not (DOCS / f"{n}.md").is_file()]
    assert not missing, f"design docs missing from the repository: {missing}"


def test_every_cited_md_file_exists():
    bad = []
    for f in code_files():
        for lineno, name in mentions(f):
            if not ((ROOT / name).is_file() or (f.parent / name).is_file()):
                bad.append(f"{f.relative_to(ROOT)}:{lineno}: {name}")
    assert not bad, ("these .md files are cited but are not files of the repository (write the path from the "
                     "repository root, e.g. docs/interfaces.md):\n" + "\n".join(bad))


def test_docs_cite_each_other_by_existing_name():
    """Inside docs/ the pages cite each other relative to docs/; citations of other projects' files
    (e.g. mini-sglang's docs/structures.md) are not ours to check."""
    bad = [f"docs/{p.name}:{lineno}: {doc}.md" for p in doc_pages() for lineno, doc, _, _ in citations(p)
           if not (DOCS / f"{doc}.md").is_file()]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", code_files() + doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_sections_exist(path):
    bad = []
    for lineno, doc, kw, nums in citations(path):
        if not (DOCS / f"{doc}.md").is_file():
            continue                               # reported by the tests above
        have = principles(doc) if kw == "principle" else headings(doc)
        what = "principle" if kw == "principle" else "section"
        bad += [f"{path.relative_to(ROOT)}:{lineno}: docs/{doc}.md has no {what} {n}" for n in nums if n not in have]
    assert not bad, "\n".join(bad)


def test_citation_parser():
    """The parser finds what the code writes (so the section test cannot pass by matching nothing)."""
    def parse(text):
        return [(d, k, n) for _, d, k, n in citations_in(text)]
    assert parse("(interfaces.md section 5)") == [("interfaces", "section", ["5"])]
    assert parse("docs/interfaces.md sections 3 and 4") == [("interfaces", "sections", ["3", "4"])]
    assert parse("kimi-k2.md 2.1-2.2, 4.1)") == [("kimi-k2", "", ["2.1", "2.2", "4.1"])]
    assert parse("(ddtree.md 1.7, default 1.0)") == [("ddtree", "", ["1.7"])]
    assert parse("kimi-k2.md section 3, ddtree.md section 1.6") == [("kimi-k2", "section", ["3"]),
                                                                     ("ddtree", "section", ["1.6"])]
    assert parse("[ddtree.md](ddtree.md) section 5") == [("ddtree", "section", ["5"])]
    assert parse("architecture.md principle 4") == [("architecture", "principle", ["4"])]
    assert parse("see interfaces.md for the JSON") == []
    assert parse("models/kimi-k26.md and my-style.md 3, other/ddtree.md 2") == []
    assert "5" in headings("interfaces") and "5.4" in headings("kimi-k2") and "4" in principles("architecture")


def test_interfaces_keeps_sections_1_to_11():
    """Code cites docs/interfaces.md by number: the numbered sections stay, in order."""
    assert {str(n) for n in range(1, 12)} <= headings("interfaces")


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in doc_pages() if p.name != "README.md" and f"]({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


def test_no_file_points_at_the_old_docs_folder():
    old = "/".join(("shared", "docs"))                 # spelled in two parts so this file does not match
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): cannot list the repository's files")
    bad = []
    for rel in filter(None, listed):
        path = ROOT / rel
        if not path.is_file():
            continue                                   # deleted in the work tree
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue                                   # binary (weights, fixtures)
        bad += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1) if old in line]
    assert not bad, f"these lines point outside the repository to {old}/ (use docs/): {bad}"
