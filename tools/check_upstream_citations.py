"""Check the package's upstream file:line citations against docs/upstream.md and the installed sources.

    python tools/check_upstream_citations.py [--suggest]

The package cites SGLang 0.5.23 and Megatron-Core 0.16.1 by file and line (``srt/layers/sampler.py:82``;
a continuation ``:186-196`` of the file named last in the same source file; lists
``:361,420,582``) in its docstrings, comments and messages. ``docs/upstream.md`` holds one row
per citation: the upstream file it means, its lines, and a line of text from within them.
Prints every citation without a row, every row without a citation and every row whose text is
no longer within its lines of the installed release (rows of another installed version are
left out), and exits 1 if there is one. ``--suggest`` also prints a candidate row for each
citation without one (the file found by its path's suffix, or the last one cited before it;
check it against the citation's text before adding it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "upstream.md"
PACKAGES = ("megatron_rl", "moe_routing")
UPSTREAM = {"sglang": ("sglang", "sglang", "0.5.23"), "megatron": ("megatron.core", "megatron-core", "0.16.1")}
"""First path component of a row's upstream file -> (module, distribution, the version cited)."""

CITATION = re.compile(r"((?:[\w.]+/)*\w+\.py)?:\s*(\d+(?:-\d+)?(?:,\s?\d+(?:-\d+)?)*)")
"""``file.py:lines`` or a continuation ``:lines`` (the file named last in the same source)."""
CONTINUATION_AFTER = re.compile(r"(``|'s |, |\()$")
"""What precedes a continuation: a code span, "model runner's", a list or a parenthesis."""


def _texts(source: str):
    """``(first line, text)`` of every string literal and comment of ``source`` (an f-string whole:
    Python 3.12 tokenizes it in pieces)."""
    lines = source.splitlines(keepends=True)
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    opened = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT) and not opened:
            yield token.start[0], token.string
        elif fstring_start is not None and token.type == fstring_start:
            opened.append(token.start)
        elif fstring_start is not None and token.type == tokenize.FSTRING_END:
            (row, col), (end_row, end_col) = opened.pop(), token.end
            if not opened:
                text = "".join(lines[row - 1 : end_row])
                yield row, text[col : len(text) - len(lines[end_row - 1]) + end_col]


def citations(source: str) -> list[tuple[int, str]]:
    """``(line, as written)`` of every citation in the strings and comments of ``source``."""
    found = []
    for first_line, text in _texts(source):
        for match in CITATION.finditer(text):
            if match.group(1) is None and not CONTINUATION_AFTER.search(text[: match.start()]):
                continue
            found.append((first_line + text.count("\n", 0, match.start()), " ".join(match.group(0).split())))
    return found


def package_citations() -> dict[tuple[str, str], int]:
    """``(file, as written) -> line`` of every citation in the package."""
    return {(path.relative_to(ROOT).as_posix(), written): line
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for line, written in citations(path.read_text(encoding="utf-8"))}


def _cells(line: str) -> list[str]:
    cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    return [re.sub(r"^(``? ?)(.*?)( ?``?)$", r"\2", c) for c in cells]


def table_rows() -> list[dict[str, str]]:
    """The rows of ``docs/upstream.md``: cited in, as written, upstream file, lines, text."""
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            cited_in, written, upstream, lines, text = _cells(line)
            rows.append({"cited_in": cited_in, "written": written, "upstream": upstream, "lines": lines, "text": text})
    return rows


def installed_root(upstream: str) -> Path | None:
    """The directory the rows of ``upstream`` (``sglang``, ``megatron``) are relative to, when
    the release they cite is the one installed; else None."""
    module, distribution, cited = UPSTREAM[upstream]
    try:
        if importlib.metadata.version(distribution) != cited:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(importlib.util.find_spec(module).origin).parents[len(module.split("."))]


def rows_that_moved(rows: list[dict[str, str]], root: Path) -> list[str]:
    """One line for each row whose text is no longer within its lines under ``root``."""
    wrong = []
    for r in rows:
        first, _, last = r["lines"].partition("-")
        lines = (root / r["upstream"]).read_text(encoding="utf-8").splitlines()
        if r["text"] not in [text.strip() for text in lines[int(first) - 1 : int(last or first)]]:
            wrong.append(f"{r['cited_in']}: {r['written']} ({r['upstream']}:{r['lines']}) no longer holds {r['text']!r}")
    return wrong


def suggest(cited_in: str, written: str) -> str:
    """A candidate row for a citation (an upstream file found by the path's suffix, else the last
    file the same source cited before it), to be checked by reading before it is added."""
    match = CITATION.match(written)
    name, spans = match.group(1), match.group(2)
    if name is None:
        earlier = [r for r in table_rows() if r["cited_in"] == cited_in]
        files = [earlier[-1]["upstream"]] if earlier else []
    else:
        files = sorted({p.relative_to(root).as_posix() for upstream in UPSTREAM
                        if (root := installed_root(upstream)) is not None
                        for p in (root / upstream).rglob("*.py") if p.as_posix().endswith("/" + name)})
    if len(files) != 1:
        return f"{cited_in}: {written}: upstream file is one of {files or 'none found'}"
    root = next(r for u in UPSTREAM if files[0].startswith(u) and (r := installed_root(u)) is not None)
    lines = (root / files[0]).read_text(encoding="utf-8").splitlines()
    out = []
    for span in spans.replace(" ", "").split(","):
        first, _, last = span.partition("-")
        text = next((t.strip() for t in lines[int(first) - 1 : int(last or first)] if t.strip()), "")
        out.append(f"| `{cited_in}` | `{written}` | `{files[0]}` | {span} | `{text.replace('|', chr(92) + '|')}` |")
    return "\n".join(out)


def problems(with_suggestions: bool = False) -> list[str]:
    """Every citation without a row, row without a citation and row that no longer holds."""
    cited, rows = package_citations(), table_rows()
    keys = {(r["cited_in"], r["written"]) for r in rows}
    found = [f"{f}:{cited[(f, w)]}: {w}: no row in docs/upstream.md" for f, w in sorted(set(cited) - keys)]
    if with_suggestions:
        found += [suggest(f, w) for f, w in sorted(set(cited) - keys)]
    found += [f"docs/upstream.md: {f}: {w}: nothing cites it" for f, w in sorted(keys - set(cited))]
    for upstream in UPSTREAM:
        root = installed_root(upstream)
        if root is not None:
            found += rows_that_moved([r for r in rows if r["upstream"].split("/")[0] == upstream], root)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suggest", action="store_true", help="print a candidate row for each citation without one")
    found = problems(parser.parse_args(argv).suggest)
    for line in found:
        print(line)
    print(f"{len(table_rows())} rows: {'every citation checked' if not found else f'{len(found)} problem(s)'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
