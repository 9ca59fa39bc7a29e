"""Every relative link and anchor of the README, launch/README.md and docs/ resolves
(``tools/check_doc_links.py``), and the checker finds a planted broken one."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_doc_links", ROOT / "tools" / "check_doc_links.py")
check_doc_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_doc_links)


def test_every_documentation_link_resolves():
    assert check_doc_links.main() == 0


def test_a_broken_file_or_anchor_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(check_doc_links, "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[fine](other.md#a-heading) [gone](missing.md) [bad](other.md#nope)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert check_doc_links.broken_links(page) == ["page.md: no file missing.md", "page.md: no heading for other.md#nope"]


def test_a_cited_test_or_fixture_that_is_gone_is_found(tmp_path, monkeypatch):
    """Issue 34: docs/async.md cited ``tests/fixtures/sync_loop_924ca5a.json`` after the file was deleted."""
    monkeypatch.setattr(check_doc_links, "ROOT", tmp_path)
    (tmp_path / "tests" / "fixtures").mkdir(parents=True)
    (tmp_path / "tests" / "fixtures" / "kept.json").write_text("{}")
    page = tmp_path / "page.md"
    page.write_text("(`tests/fixtures/sync_loop_924ca5a.json`), `tests/fixtures/kept.json`.\n"
                    "```bash\npytest -q tests/unit/test_gone.py -k x\n```\n")
    assert check_doc_links.broken_links(page) == [
        "page.md: cites tests/fixtures/sync_loop_924ca5a.json, which does not exist",
        "page.md: cites tests/unit/test_gone.py, which does not exist"]
