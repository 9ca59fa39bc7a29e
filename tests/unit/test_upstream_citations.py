"""Upstream file:line citations are checked against the upstream sources, through one table.

The package cites SGLang 0.5.23 and Megatron-Core 0.16.1 by file and line where it keeps one
of their rules; each citation has a row in ``docs/upstream.md`` (the upstream file it means,
its lines, a line of text from within them; ``tools/check_upstream_citations.py``). Shown:
every citation in the package has a row and every row a citation; every row's text still sits
within its lines of the installed release (a release that moved or changed the code fails
here, naming the row; rows of another installed version are skipped). A planted source shows
what counts as a citation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_upstream_citations", ROOT / "tools" / "check_upstream_citations.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_every_citation_has_a_row_and_every_row_a_citation():
    cited = set(check.package_citations())
    rows = {(r["cited_in"], r["written"]) for r in check.table_rows()}
    assert len(cited) > 100
    assert sorted(cited - rows) == [], "citations without a row in docs/upstream.md"
    assert sorted(rows - cited) == [], "rows of docs/upstream.md that nothing cites"


@pytest.mark.parametrize("upstream", sorted(check.UPSTREAM))
def test_each_row_holds_in_the_installed_release(upstream):
    root = check.installed_root(upstream)
    if root is None:
        pytest.skip(f"{check.UPSTREAM[upstream][1]} {check.UPSTREAM[upstream][2]} is not the installed release")
    rows = [r for r in check.table_rows() if r["upstream"].split("/")[0] == upstream]
    assert rows
    assert check.rows_that_moved(rows, root) == []


def test_a_row_whose_lines_moved_is_named(tmp_path):
    row = next(r for r in check.table_rows() if r["upstream"].startswith("sglang/"))
    moved = dict(row, lines=str(int(row["lines"].partition("-")[0]) + 10_000))
    root = check.installed_root("sglang")
    assert root is not None
    (tmp_path / row["upstream"]).parent.mkdir(parents=True)
    (tmp_path / row["upstream"]).write_text((root / row["upstream"]).read_text() + "\n" * 10_001)
    assert check.rows_that_moved([row], root) == []
    assert check.rows_that_moved([moved], tmp_path) == [
        f"{row['cited_in']}: {row['written']} ({row['upstream']}:{moved['lines']}) no longer holds {row['text']!r}"]


def test_the_scanner_counts_what_reads_as_a_citation():
    source = '''
def f(x):
    """SGLang's rule (``srt/layers/sampler.py:82``, ``:186-196``; the model runner's
    ``weight_updater.py:
    275-278``, a list ``optimizer.py:671,690``, then (tokenizer_control_mixin.py:451, :509)."""
    y = x[:, :5]  # not one: code; this is: distrib_optimizer.py:1772
    return f"http://127.0.0.1:8000 at 12:30 {y}"
'''
    assert check.citations(source) == [
        (3, "srt/layers/sampler.py:82"), (3, ":186-196"), (4, "weight_updater.py: 275-278"),
        (5, "optimizer.py:671,690"), (5, "tokenizer_control_mixin.py:451"), (5, ":509"),
        (6, "distrib_optimizer.py:1772"),
    ]
