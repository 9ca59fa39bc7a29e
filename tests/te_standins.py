"""A stand-in ``transformer_engine`` package, so that Megatron-Core's own TE layer spec and
TE wrapper classes build a model on a CPU-only machine (TE cannot be installed here: its
torch extension needs CUDA).

What is real: everything Megatron owns: ``get_gpt_decoder_block_spec(...,
use_transformer_engine=True)``, ``TESpecProvider``, the ``TE*`` wrappers of
``megatron.core.extensions.transformer_engine`` (their ``__init__``, parallel attributes
and ``sharded_state_dict``), ``TEGroupedMLP``, the layers and the model. What is stood in:
only the TE base classes those wrappers subclass, each declaring the parameters, tensor
parallel attributes and extra state that TE itself declares. Sources, NVIDIA/
TransformerEngine at d0067d0 (2.20.0.dev0; the names are the same at tags v2.0 and v2.8),
``transformer_engine/pytorch/``:

- ``module/linear.py`` ``Linear.__init__``: ``weight`` [out, in] (out / tp for parallel_mode
  "column", in / tp for "row"), ``bias`` a parameter only when ``bias=True`` (else a plain
  empty tensor attribute); ``reset_parameters``: every weight gets
  ``set_tensor_model_parallel_attributes(is_parallel=True, dim=1 if row else 0, stride=1)``
  whatever the mode.
- ``module/layernorm_linear.py`` ``LayerNormLinear.__init__``: ``layer_norm_weight`` [in]
  first, ``layer_norm_bias`` only when ``normalization != "RMSNorm"``, then the Linear's
  ``weight``/``bias``; the norm parameters carry ``sequence_parallel``.
- ``module/grouped_linear.py`` ``GroupedLinear.__init__``: ``weight{i}`` [out, in] and
  ``bias{i}`` (only with ``bias=True``) for ``i < num_gemms``.
- ``module/rmsnorm.py`` / ``ops/basic/rmsnorm.py``: ``RMSNorm.weight`` [hidden], flagged
  ``sequence_parallel``; ``module/layernorm.py``: ``LayerNorm.weight``, ``.bias``; both
  are ``ops/op.py`` ``BasicOperation``s, which also have ``get_extra_state``.
- ``module/base.py`` ``TransformerEngineBaseModule``: ``register_parameter`` takes
  ``init_fn``/``get_rng_state_tracker``/``fp8_meta_index``; ``get_extra_state`` returns
  ``torch.empty(0, dtype=torch.uint8)`` when there is no FP8 state; ``fp8_meta`` holds
  ``fp8_checkpoint``.
- ``attention/dot_product_attention/dot_product_attention.py``: ``DotProductAttention``
  has no parameters.

Forward passes are not stood in (the stand-ins raise): these models are for names, shapes,
parallel attributes and checkpoints only. :func:`install` must run before Megatron is
imported, in a process of its own (a ``run_world`` rank, which is spawned fresh).
"""

from __future__ import annotations

import sys
import types

import torch

TE_VERSION = "2.8.0"
"""A TE release Megatron-Core 0.16 supports; from 2.7 on Megatron also imports TE's fused
router functions at import time (stood in, never called: ``moe_router_fusion`` is off)."""


class _TEModule(torch.nn.Module):
    """What the wrappers use of ``TransformerEngineBaseModule``."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}

    def register_parameter(self, name, param, **te_kwargs) -> None:  # noqa: D102 (TE's signature)
        init_fn = te_kwargs.get("init_fn")
        if param is not None and init_fn is not None:
            with torch.no_grad():
                init_fn(param)
        super().register_parameter(name, param)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE sets up FP8 scaling state here; there is none without FP8."""

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def forward(self, *args, **kwargs):
        raise NotImplementedError("Transformer Engine stand-in: names and checkpoints only")


def _tp_attributes(tensor: torch.Tensor, dim: int) -> None:
    tensor.tensor_model_parallel = True
    tensor.partition_dim = dim
    tensor.partition_stride = 1


def _features(in_features: int, out_features: int, parallel_mode, tp_size: int, tp_group) -> tuple[int, int]:
    if tp_group is not None:
        tp_size = torch.distributed.get_world_size(tp_group)
    if parallel_mode == "column":
        return in_features, out_features // tp_size
    if parallel_mode == "row":
        return in_features // tp_size, out_features
    return in_features, out_features


class Linear(_TEModule):
    def __init__(self, in_features, out_features, **kwargs):
        super().__init__()
        self._init_linear(in_features, out_features, **kwargs)

    def _init_linear(self, in_features, out_features, *, sequence_parallel=False, tp_group=None, tp_size=1,
                     init_method=None, bias=True, parallel_mode=None, params_dtype=None, device="cpu", **unused):
        self.in_features, self.out_features = _features(in_features, out_features, parallel_mode, tp_size, tp_group)
        self.parallel_mode, self.use_bias, self.sequence_parallel = parallel_mode, bias, sequence_parallel
        dtype = params_dtype or torch.float32
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
        self.register_parameter("weight", torch.nn.Parameter(weight), init_fn=init_method)
        _tp_attributes(self.weight, 1 if parallel_mode == "row" else 0)
        if bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)))
            if parallel_mode == "column":
                _tp_attributes(self.bias, 0)
            elif parallel_mode == "row":
                self.bias.sequence_parallel = sequence_parallel
        else:
            self.bias = torch.Tensor().to(dtype=dtype, device=device)


class LayerNormLinear(Linear):
    def __init__(self, in_features, out_features, eps=1e-5, *, normalization="LayerNorm", params_dtype=None,
                 device="cpu", sequence_parallel=False, **kwargs):
        _TEModule.__init__(self)
        dtype = params_dtype or torch.float32
        self.normalization, self.eps = normalization, eps
        # layernorm_linear.py registers the norm parameters before the linear ones.
        norm_weight = torch.nn.Parameter(torch.ones(in_features, dtype=dtype, device=device))
        self.register_parameter("layer_norm_weight", norm_weight)
        self.layer_norm_weight.sequence_parallel = sequence_parallel
        if normalization != "RMSNorm":
            norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=dtype, device=device))
            self.register_parameter("layer_norm_bias", norm_bias)
            self.layer_norm_bias.sequence_parallel = sequence_parallel
        else:
            self.layer_norm_bias = None
        self._init_linear(in_features, out_features, sequence_parallel=sequence_parallel, params_dtype=dtype,
                          device=device, **kwargs)


class GroupedLinear(_TEModule):
    def __init__(self, num_gemms, in_features, out_features, *, sequence_parallel=False, tp_group=None, tp_size=1,
                 init_method=None, bias=True, parallel_mode=None, params_dtype=None, device="cpu", **unused):
        super().__init__()
        self.num_gemms = num_gemms
        self.in_features, self.out_features = _features(in_features, out_features, parallel_mode, tp_size, tp_group)
        self.parallel_mode, self.use_bias, self.sequence_parallel = parallel_mode, bias, sequence_parallel
        dtype = params_dtype or torch.float32
        for i in range(num_gemms):
            weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight), init_fn=init_method)
            _tp_attributes(getattr(self, f"weight{i}"), 1 if parallel_mode == "row" else 0)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype, device=device))


class RMSNorm(_TEModule):
    # TE 2.x names the size ``normalized_shape`` (``hidden_size`` is its older keyword):
    # megatron-core 0.16.1 passes it positionally, 0.19.2 as ``normalized_shape=``.
    def __init__(self, normalized_shape=None, eps=1e-5, sequence_parallel=None, params_dtype=None, device="cpu",
                 hidden_size=None, **unused):
        super().__init__()
        hidden_size = normalized_shape if hidden_size is None else hidden_size
        self.register_parameter("weight", torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)))
        if sequence_parallel is not None:
            self.weight.sequence_parallel = sequence_parallel


class LayerNorm(RMSNorm):
    def __init__(self, normalized_shape=None, eps=1e-5, sequence_parallel=None, params_dtype=None, device="cpu",
                 hidden_size=None, **unused):
        hidden_size = normalized_shape if hidden_size is None else hidden_size
        super().__init__(hidden_size, eps, sequence_parallel, params_dtype, device)
        self.register_parameter("bias", torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)))
        if sequence_parallel is not None:
            self.bias.sequence_parallel = sequence_parallel


class DotProductAttention(_TEModule):
    def __init__(self, *args, **kwargs):
        super().__init__()


class _Recipe:
    def __init__(self, *args, **kwargs):
        pass


class _FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def with_fp8_parameters() -> bool:
        return False


def _unavailable(*args, **kwargs):
    raise NotImplementedError("Transformer Engine stand-in")


def install() -> None:
    """Register the stand-in ``transformer_engine`` in ``sys.modules`` (before Megatron imports)."""
    if "megatron.core" in sys.modules:
        raise RuntimeError("install the Transformer Engine stand-in before Megatron-Core is imported")
    modules = {}

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so that submodule imports resolve through sys.modules
        modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, mod)
        return mod

    module("transformer_engine", __version__=TE_VERSION)
    module("transformer_engine.common")
    module("transformer_engine.common.recipe", DelayedScaling=_Recipe, Format=types.SimpleNamespace(E4M3=0, HYBRID=1))
    module("transformer_engine.pytorch", Linear=Linear, LayerNormLinear=LayerNormLinear, GroupedLinear=GroupedLinear,
           RMSNorm=RMSNorm, LayerNorm=LayerNorm, DotProductAttention=DotProductAttention)
    # Only named in annotations and in the op-fuser MLP, which this project does not build.
    module("transformer_engine.pytorch.ops", **{op: _Recipe for op in (
        "Sequential", "FusibleOperation", "SwiGLU", "GEGLU", "ReGLU", "GELU", "ReLU", "SiLU", "BasicLinear", "Bias",
        "AllReduce", "ReduceScatter", "LayerNorm", "RMSNorm")})
    # isinstance checks of Megatron's FP8 utilities: no parameter here is quantized.
    module("transformer_engine.pytorch.tensor", QuantizedTensor=type("QuantizedTensor", (torch.Tensor,), {}))
    # fp8_model_init: megatron-core 0.19 imports it with the other two to decide HAVE_TE.
    module("transformer_engine.pytorch.fp8", FP8GlobalStateManager=_FP8GlobalStateManager, fp8_autocast=_unavailable,
           fp8_model_init=_unavailable)
    module("transformer_engine.pytorch.distributed", CudaRNGStatesTracker=_Recipe, checkpoint=_unavailable,
           activation_recompute_forward=_unavailable)
    module("transformer_engine.pytorch.router", fused_compute_score_for_moe_aux_loss=_unavailable,
           fused_moe_aux_loss=_unavailable, fused_topk_with_score_function=_unavailable)
    sys.modules.update(modules)
