"""Check the relative links of README.md, launch/README.md and docs/*.md.

    python tools/check_doc_links.py

Every link that is not a URL must name an existing file, and its ``#anchor`` (if any) a
heading of that file, slugged as GitHub slugs headings. Links inside fenced code blocks are
ignored. Every path under ``tests/`` a page cites (a test, a fixture; in code too) must exist
in the checkout. Prints each broken link or citation and exits 1 if there is one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CITED = re.compile(r"(?<![\w/.])tests/[\w./-]*[\w/]")
"""A path under the repository's tests/ (a fixture, a test file), wherever a page names it."""


def heading_slugs(md: Path) -> set[str]:
    """GitHub's anchors of ``md``'s headings: lower case, punctuation dropped, spaces -> '-'."""
    slugs, seen = set(), {}
    for line in FENCED.sub("", md.read_text()).splitlines():
        if not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def broken_links(md: Path) -> list[str]:
    """``md``'s relative links whose file or anchor does not exist."""
    broken = []
    for target in LINK.findall(FENCED.sub("", md.read_text())):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{md.relative_to(ROOT)}: no file {target}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_slugs(dest):
            broken.append(f"{md.relative_to(ROOT)}: no heading for {target}")
    for cited in dict.fromkeys(CITED.findall(md.read_text())):
        if not (ROOT / cited).exists():
            broken.append(f"{md.relative_to(ROOT)}: cites {cited}, which does not exist")
    return broken


def main() -> int:
    pages = [ROOT / "README.md", ROOT / "launch" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [line for md in pages for line in broken_links(md)]
    print("\n".join(broken) or f"{len(pages)} pages: every relative link resolves")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
