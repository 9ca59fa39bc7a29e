"""The fp8 section: validation against a machine, TransformerConfig fields, TE recipe objects.

Transformer Engine cannot be installed on a CPU machine, so recipe building and the
autocast are checked against a small fake ``transformer_engine`` package; the real one
runs in tests/gpu/test_fp8_gpu.py.
"""

import dataclasses
import importlib.util
import sys
import types
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest

from megatron_rl import fp8
from megatron_rl.config_loading import ConfigError
from megatron_rl.fp8 import (
    FP8Config,
    Fp8Environment,
    build_te_recipe,
    check_fp8,
    detect_fp8_environment,
    fp8_autocast,
    transformer_config_fields,
    validate_fp8,
)
from megatron_rl.config import load_config

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
CPU = Fp8Environment(te_version=None, cuda_available=False, compute_capability=None)


def _gpu(cc, te="2.8.0", cuda="12.9"):
    return Fp8Environment(te_version=te, cuda_available=True, compute_capability=cc, cuda_version=cuda)


def _rejected(cfg, env, key, rule):
    with pytest.raises(ConfigError) as err:
        validate_fp8(cfg, env)
    assert str(err.value).startswith(f"{key}: ") and rule in str(err.value), str(err.value)


def test_disabled_fp8_needs_nothing():
    validate_fp8(FP8Config(), CPU)
    check_fp8(FP8Config())
    assert transformer_config_fields(FP8Config()) == {}


@pytest.mark.parametrize(
    "env, rule",
    [
        (CPU, "Transformer Engine does not import here (install it on a CUDA machine: pip install -e '.[te]'); "
              "torch sees no CUDA GPU"),
        (dataclasses.replace(CPU, te_version="2.8.0"), "but torch sees no CUDA GPU"),
        (dataclasses.replace(_gpu((9, 0)), te_version=None), "but Transformer Engine does not import here"),
    ],
)
def test_fp8_without_te_or_cuda_is_rejected(env, rule):
    _rejected(FP8Config(enabled=True), env, "fp8.enabled", rule)


def test_fp8_without_te_fails_when_the_config_loads_here():
    with pytest.raises(ConfigError, match=r"^fp8.enabled: FP8 training needs Transformer Engine"):
        load_config(DEMO, ["fp8.enabled=true"])
    with pytest.raises(ConfigError, match=r"^fp8.recipe: 'fp4' is not one of"):
        load_config(DEMO, ["fp8.recipe=fp4"])
    assert load_config(DEMO, ["fp8.recipe=blockwise", "fp8.format=e4m3"]).fp8.recipe == "blockwise"


@pytest.mark.parametrize(
    "recipe, env, key, rule",
    [
        ("delayed", _gpu((8, 0)), "fp8.enabled", "compute capability >= 8.9 (Ada, Hopper, Blackwell); this GPU is 8.0"),
        ("mxfp8", _gpu((9, 0)), "fp8.recipe", "mxfp8 needs a data-center Blackwell GPU"),
        ("mxfp8", _gpu((12, 0)), "fp8.recipe", "this GPU is 12.0"),
        ("blockwise", _gpu((8, 9)), "fp8.recipe", "blockwise needs compute capability >= 9.0 (Hopper)"),
        ("blockwise", _gpu((9, 0), cuda="12.4"), "fp8.recipe", "blockwise needs CUDA >= 12.9; torch uses CUDA 12.4"),
        ("blockwise", _gpu((9, 0), te="2.2.1"), "fp8.recipe", "blockwise needs Transformer Engine >= 2.3"),
        ("tensorwise", _gpu((9, 0), te="2.1.0"), "fp8.recipe", "tensorwise needs Transformer Engine >= 2.2"),
        ("delayed", _gpu((9, 0), te="1.6.0"), "fp8.recipe", "delayed needs Transformer Engine >= 1.7"),
    ],
)
def test_recipe_the_machine_cannot_run_is_rejected(recipe, env, key, rule):
    _rejected(FP8Config(enabled=True, recipe=recipe), env, key, rule)


@pytest.mark.parametrize(
    "recipe, cc",
    [("delayed", (8, 9)), ("tensorwise", (9, 0)), ("blockwise", (9, 0)), ("blockwise", (10, 0)),
     ("mxfp8", (10, 0))],
)
def test_recipe_the_machine_runs_is_accepted(recipe, cc):
    validate_fp8(FP8Config(enabled=True, recipe=recipe), _gpu(cc))


@pytest.mark.parametrize(
    "cfg, key, rule",
    [
        (FP8Config(amax_history_len=0), "fp8.amax_history_len", "must be >= 1"),
        (FP8Config(margin=-1), "fp8.margin", "must be >= 0"),
        (FP8Config(recipe="tensorwise", amax_history_len=16), "fp8.amax_history_len",
         "only the delayed recipe uses it, but fp8.recipe is 'tensorwise'"),
        (FP8Config(recipe="blockwise", amax_compute_algo="most_recent"), "fp8.amax_compute_algo", "only the delayed"),
    ],
)
def test_inconsistent_section_is_rejected_even_when_disabled(cfg, key, rule):
    _rejected(cfg, CPU, key, rule)


def test_transformer_config_fields_name_real_megatron_fields():
    from megatron.core.transformer import TransformerConfig

    delayed = transformer_config_fields(FP8Config(enabled=True, amax_history_len=16, margin=1))
    assert delayed == {"fp8": "hybrid", "fp8_recipe": "delayed", "moe_router_dtype": "fp32", "fp8_margin": 1,
                       "fp8_amax_history_len": 16, "fp8_amax_compute_algo": "max"}
    blockwise = transformer_config_fields(
        FP8Config(enabled=True, recipe="blockwise", format="e4m3", keep_router_high_precision=False))
    assert blockwise == {"fp8": "e4m3", "fp8_recipe": "blockwise", "moe_router_dtype": None}
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(delayed) <= names and set(blockwise) <= names


def test_without_te_recipes_fail_clearly_and_disabled_autocast_is_a_no_op():
    with pytest.raises(ConfigError, match=r"^fp8.recipe: building an FP8 recipe needs Transformer Engine"):
        build_te_recipe(FP8Config(enabled=True))
    with fp8_autocast(FP8Config()):
        pass
    with pytest.raises(ConfigError, match="needs Transformer Engine"):
        with fp8_autocast(FP8Config(enabled=True)):
            pass


def test_this_machine_is_detected():
    import torch

    env = detect_fp8_environment()
    assert env.cuda_available == torch.cuda.is_available()
    assert (env.compute_capability is None) == (not env.cuda_available)
    assert env.te_version == fp8.te_version()
    if importlib.util.find_spec("transformer_engine") is None:
        assert env.te_version is None


# --------------------------------------------------------------------------- fake TE


class _Format(Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclass
class _Recipe:
    fp8_format: _Format = _Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


def _fake_te(monkeypatch, with_new_autocast):
    """Install a fake transformer_engine whose autocast records its arguments."""
    recipe_mod = types.ModuleType("transformer_engine.common.recipe")
    recipe_mod.Format = _Format
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        setattr(recipe_mod, name, type(name, (_Recipe,), {}))
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe_mod
    pytorch = types.ModuleType("transformer_engine.pytorch")
    entered = []

    class _Context:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def __enter__(self):
            entered.append(self.kwargs)

        def __exit__(self, *exc):
            entered.append("exit")

    if with_new_autocast:
        pytorch.autocast = _Context
    else:
        pytorch.fp8_autocast = _Context
    root = types.ModuleType("transformer_engine")
    root.__version__ = "2.8.0+abc"
    root.common, root.pytorch = common, pytorch
    for name, mod in (("transformer_engine", root), ("transformer_engine.common", common),
                      ("transformer_engine.common.recipe", recipe_mod), ("transformer_engine.pytorch", pytorch)):
        monkeypatch.setitem(sys.modules, name, mod)
    return entered


@pytest.mark.parametrize(
    "cfg, cls, fields",
    [
        (FP8Config(enabled=True, amax_history_len=16, amax_compute_algo="most_recent", margin=2), "DelayedScaling",
         dict(fp8_format=_Format.HYBRID, margin=2, amax_history_len=16, amax_compute_algo="most_recent")),
        (FP8Config(enabled=True, recipe="tensorwise"), "Float8CurrentScaling", dict(fp8_format=_Format.HYBRID)),
        (FP8Config(enabled=True, recipe="blockwise", format="e4m3"), "Float8BlockScaling",
         dict(fp8_format=_Format.E4M3)),
        (FP8Config(enabled=True, recipe="mxfp8", format="e4m3"), "MXFP8BlockScaling", dict(fp8_format=_Format.E4M3)),
    ],
)
def test_recipe_objects_map_the_section(cfg, cls, fields, monkeypatch):
    _fake_te(monkeypatch, with_new_autocast=True)
    recipe = build_te_recipe(cfg)
    assert type(recipe).__name__ == cls
    assert {k: getattr(recipe, k) for k in fields} == fields
    assert fp8.te_version() == "2.8.0+abc"


@pytest.mark.parametrize("new_api, group_key", [(True, "amax_reduction_group"), (False, "fp8_group")])
def test_autocast_enters_te_with_the_recipe_and_group(new_api, group_key, monkeypatch):
    entered = _fake_te(monkeypatch, with_new_autocast=new_api)
    with fp8_autocast(FP8Config(enabled=True, recipe="tensorwise"), amax_reduction_group="G"):
        assert len(entered) == 1
    kwargs = entered[0]
    assert kwargs["enabled"] is True and kwargs[group_key] == "G"
    assert type(kwargs["recipe" if new_api else "fp8_recipe"]).__name__ == "Float8CurrentScaling"
    assert entered[-1] == "exit"
