"""Packages Megatron-Core imports only to know they are installed run when first used, once.

The mechanism is checked on a package written here (it counts its own executions); the real
case, importing Megatron-Core's GPT model with wandb installed, in a fresh interpreter.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.deferred_imports import defer_optional_imports, is_deferred


@pytest.fixture
def package(tmp_path, monkeypatch):
    """``deferpkg`` (with ``deferpkg.sub``, which its ``__init__`` imports, and ``deferpkg.other``,
    which it does not), each appending its name to ``RUNS`` of a module of its own when it runs."""
    root = tmp_path / "deferpkg"
    root.mkdir()
    (tmp_path / "deferruns.py").write_text("RUNS = []\n")
    (root / "__init__.py").write_text(textwrap.dedent("""
        import deferruns
        deferruns.RUNS.append("deferpkg")
        from deferpkg import sub
        VALUE = sub.VALUE + 1
    """))
    (root / "sub.py").write_text("import deferruns\ndeferruns.RUNS.append('sub')\nVALUE = 41\n")
    (root / "other.py").write_text("import deferruns\ndeferruns.RUNS.append('other')\nimport deferpkg\nSEEN = deferpkg.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("deferruns").RUNS
    for name in [n for n in sys.modules if n.split(".")[0] in ("deferpkg", "deferruns")]:
        del sys.modules[name]


def test_a_deferred_package_runs_at_its_first_attribute_and_only_then(package):
    defer_optional_imports(("deferpkg",))
    import inspect

    import deferpkg

    inspect.getmodule(test_a_deferred_package_runs_at_its_first_attribute_and_only_then)  # reads every module's __file__
    assert package == [] and is_deferred(deferpkg) and deferpkg.__path__ and deferpkg.__file__
    assert deferpkg.VALUE == 42 and package == ["deferpkg", "sub"] and not is_deferred(deferpkg)
    assert deferpkg.VALUE == 42 and package == ["deferpkg", "sub"]


@pytest.mark.parametrize("first", ["deferpkg.sub", "deferpkg.other"])
def test_a_submodule_imported_first_runs_its_package_first_and_nothing_twice(package, first):
    defer_optional_imports(("deferpkg",))
    module = importlib.import_module(first)
    assert sorted(package) == sorted(["deferpkg", "sub"] + (["other"] if first == "deferpkg.other" else []))
    assert sys.modules[first] is module and module.__spec__.name == first
    assert type(module.__spec__.loader).__name__ == "SourceFileLoader"  # its own spec, not the finder's
    assert importlib.import_module("deferpkg").VALUE == 42 and getattr(sys.modules["deferpkg"], first.split(".")[1]) is module


def test_two_threads_first_asking_at_once_both_get_the_run_package(package, tmp_path):
    (tmp_path / "deferpkg" / "__init__.py").write_text(textwrap.dedent("""
        import time, deferruns
        deferruns.RUNS.append("deferpkg")
        time.sleep(0.3)  # the second thread asks while this runs
        VALUE = 42
    """))
    defer_optional_imports(("deferpkg",))
    import deferpkg

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        values = list(pool.map(lambda _: deferpkg.VALUE, range(2)))
    assert values == [42, 42] and package == ["deferpkg"]


def test_a_package_whose_run_fails_is_left_out_as_a_failed_import_is(package, tmp_path):
    (tmp_path / "deferpkg" / "__init__.py").write_text("raise RuntimeError('broken package')\n")
    defer_optional_imports(("deferpkg",))
    import deferpkg

    with pytest.raises(RuntimeError, match="broken package"):
        deferpkg.VALUE
    assert "deferpkg" not in sys.modules
    with pytest.raises(RuntimeError, match="broken package"):
        importlib.import_module("deferpkg")


def test_an_absent_package_stays_absent_and_an_imported_one_is_left_as_it_is(package):
    defer_optional_imports(("deferpkg_not_installed",))
    assert "deferpkg_not_installed" not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module("deferpkg_not_installed")
    loaded = importlib.import_module("deferpkg")
    defer_optional_imports(("deferpkg",))
    assert sys.modules["deferpkg"] is loaded and not is_deferred(loaded) and package == ["deferpkg", "sub"]


def test_importing_megatron_does_not_run_wandb_until_it_is_used():
    pytest.importorskip("wandb")
    code = textwrap.dedent("""
        import sys, warnings
        warnings.simplefilter("ignore")
        import megatron_rl, megatron.core.models.gpt
        from megatron.core import timers
        assert timers.wandb is not None, "megatron sees wandb installed"
        assert "wandb.sdk" not in sys.modules, sorted(m for m in sys.modules if m.startswith("wandb"))
        import wandb
        assert callable(wandb.init) and "wandb.sdk" in sys.modules and timers.wandb is wandb
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
