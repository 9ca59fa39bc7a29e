"""A live transformers model for the HF rollout engine, and loading HF-named tensors into it.

Shape legend: E experts per layer, F one expert's FFN width, H hidden size.

Owns: building the transformers causal-LM of a mapped architecture (Qwen3-MoE, Mixtral,
GPT-OSS, Qwen3-Next, Qwen3.5: as its language model)
from a :class:`~megatron_rl.config.ModelConfig` (through the same generated ``config.json``
the HF export writes), and :class:`HFWeightLoader`, which copies tensors named as in an HF
*checkpoint* (the names ``megatron_rl.checkpoint.mapping`` produces, which SGLang loads)
into the model's parameters. transformers 5 stores each layer's experts fused
(``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` = per expert ``[gate; up]``, and
``mlp.experts.down_proj`` ``[E, H, F]``) and renames Mixtral's ``block_sparse_moe`` to
``mlp``; the rules here are those of transformers' own checkpoint conversion
(``conversion_mapping.py``: ``qwen2_moe`` and ``mixtral``: MergeModulelist(dim=0) then
Concatenate(dim=1)), and a test loads the same tensors with ``from_pretrained`` to prove
it. A load must cover every parameter exactly once, or it fails naming what is missing.

Does not own the HF <-> Megatron table (``mapping``), gathering weights from a Megatron
model (``weight_sync.gather_full_params``) or generation (``hf_generate``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_rl.checkpoint.hf_config import hf_config_from_model
from megatron_rl.sections import ModelConfig


@dataclass(frozen=True)
class ExpertLayout:
    """How one architecture's per-expert checkpoint tensors land in transformers' fused experts."""

    layer_rename: tuple[str, str] | None
    """``(checkpoint, model)`` module-name fragment to rename (Mixtral's ``block_sparse_moe``)."""
    gate: str
    """Per-expert gate projection name (first half of ``gate_up_proj``)."""
    up: str
    """Per-expert up projection name (second half of ``gate_up_proj``)."""
    down: str
    """Per-expert down projection name (``down_proj``)."""
    attention: str = "sdpa"
    """transformers attention implementation (GPT-OSS's sinks: eager; it refuses SDPA)."""
    stacked: bool = False
    """The checkpoint's expert tensors are transformers' stacked parameters themselves (GPT-OSS): one piece each."""
    replica: str | None = None
    """Architecture the replica is built as, when not this one (Qwen3.5's vision-language
    checkpoints: their language model, ``qwen3_5_moe_text``)."""


EXPERT_LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": ExpertLayout(layer_rename=None, gate="gate_proj", up="up_proj", down="down_proj"),
    # Mixtral: w1 gate, w3 up, w2 down (transformers' "mixtral" conversion rules).
    "mixtral": ExpertLayout(layer_rename=(".block_sparse_moe.", ".mlp."), gate="w1", up="w3", down="w2"),
    # GPT-OSS checkpoints hold each layer's experts stacked, as transformers' parameters are:
    # its names are the parameters' own (the per-expert fields are never matched).
    "gpt_oss": ExpertLayout(layer_rename=None, gate="gate_proj", up="up_proj", down="down_proj", attention="eager",
                            stacked=True),
    # transformers' own "qwen2_moe" rules again (conversion_mapping.py: qwen3_next, qwen3_5_moe_text);
    # Qwen3.5's vision-language names drop "language_model" (its PrefixChange for qwen3_5_moe).
    "qwen3_next": ExpertLayout(layer_rename=None, gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen3_5_moe_text": ExpertLayout(layer_rename=None, gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen3_5_moe": ExpertLayout(layer_rename=("model.language_model.", "model."), gate="gate_proj", up="up_proj",
                                down="down_proj", replica="qwen3_5_moe_text"),
}
"""Architectures the HF engine can serve (keys of ``mapping.ARCHITECTURES``)."""


MIN_TRANSFORMERS = "5.24.0"
"""``hf_generate`` hands the KV cache to the model as ``cache=``, the keyword transformers 5.24
introduced (``past_key_values`` before): an earlier release takes it into ``**kwargs`` and decodes
every step without the cache, silently wrong (6.1 nats off at 5.17.0)."""


class UnsupportedArchitecture(ValueError):
    """The HF engine has no transformers weight layout for this architecture."""


def check_transformers(version: str) -> None:
    """Refuse a transformers release the engine would decode wrongly with.

    Raises:
        RuntimeError: naming the version found and the one needed.
    """
    from packaging.version import Version

    if Version(version) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(f"the hf rollout engine needs transformers >= {MIN_TRANSFORMERS} (it passes the KV cache "
                           f"as cache=, which earlier releases ignore); this is transformers {version}")


def check_architecture(architecture: str) -> ExpertLayout:
    """The layout of ``architecture``, or an error naming it and the supported ones."""
    layout = EXPERT_LAYOUTS.get(architecture)
    if layout is None:
        raise UnsupportedArchitecture(
            f"the hf rollout engine cannot serve architecture {architecture!r}: no transformers weight "
            f"layout (supported: {', '.join(sorted(EXPERT_LAYOUTS))}); use rollout.engine=megatron or sglang"
        )
    return layout


def check_servable(architecture: str, model: ModelConfig) -> None:
    """Fail before any process starts if the engine cannot build ``model`` as ``architecture``.

    Raises:
        UnsupportedArchitecture: no layout for the architecture (named).
        CheckpointMismatchError: the architecture cannot represent the model (``model.<field>`` named).
    """
    check_architecture(architecture)
    hf_config_from_model(architecture, model, model.params_dtype)


def build_hf_model(
    architecture: str, model: ModelConfig, device: torch.device | str = "cpu", dtype: str | None = None
) -> torch.nn.Module:
    """transformers' causal LM of ``architecture`` computing what ``model`` computes (weights unset).

    The config is the HF export's (``hf_config_from_model``), so the engine runs exactly
    the model an exported checkpoint would load as. SDPA attention, eager experts; weights
    in ``dtype`` (default ``model.params_dtype``).
    """
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    check_transformers(transformers.__version__)
    layout = check_architecture(architecture)
    config_dict = hf_config_from_model(layout.replica or architecture, model, model.params_dtype)
    config_dict.pop("architectures")
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    torch_dtype = getattr(torch, dtype or model.params_dtype)
    # Made where it runs: initialising billions of (soon overwritten) weights on the host first
    # costs tens of seconds of CPU before a GPU engine can start.
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=layout.attention)
    return hf.to(device).eval().requires_grad_(False)


_EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class HFWeightLoader:
    """Copies HF-checkpoint-named tensors into a live model; ``finish()`` checks full coverage.

    Args:
        hf_model: the transformers model (its parameters are overwritten in place).
        architecture: its ``model_type`` (a key of :data:`EXPERT_LAYOUTS`).
    """

    def __init__(self, hf_model: torch.nn.Module, architecture: str) -> None:
        self.layout = check_architecture(architecture)
        self.params = dict(hf_model.named_parameters())
        self.written: dict[str, int] = {}
        """Parameter name -> tensors copied into it since the last ``finish()`` (a fused
        ``gate_up_proj`` takes 2E, a fused ``down_proj`` E, anything else one)."""

    def _target(self, name: str) -> tuple[str, torch.Tensor]:
        """The model parameter name and the view of it that checkpoint tensor ``name`` fills."""
        if self.layout.layer_rename is not None:
            name = name.replace(*self.layout.layer_rename)
        match = _EXPERT_NAME.match(name)
        if match is None:
            if name not in self.params:
                raise KeyError(f"HF weight {name!r} matches no parameter of the transformers model")
            return name, self.params[name]
        prefix, expert, proj = match["prefix"], int(match["expert"]), match["proj"]
        lay = self.layout
        if proj == lay.down:
            fused = self.params.get(prefix + ".down_proj")
            target = fused[expert] if fused is not None else None
            key = prefix + ".down_proj"
        elif proj in (lay.gate, lay.up):
            fused = self.params.get(prefix + ".gate_up_proj")
            key = prefix + ".gate_up_proj"
            target = None
            if fused is not None:
                half = fused.shape[1] // 2
                target = fused[expert, :half] if proj == lay.gate else fused[expert, half:]
        else:
            target = None
        if target is None:
            raise KeyError(f"HF weight {name!r} matches no fused expert parameter of the transformers model")
        return key, target

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into its place (shape checked, naming the tensor)."""
        key, target = self._target(name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"HF weight {name}: shape {tuple(tensor.shape)}, the transformers model "
                             f"expects {tuple(target.shape)} at {key}")
        target.copy_(tensor)
        self.written[key] = self.written.get(key, 0) + 1

    def finish(self) -> None:
        """Fail unless every parameter was written exactly as often as it has pieces."""
        problems = []
        for key, param in self.params.items():
            pieces = 1
            if key.endswith(".experts.gate_up_proj") and not self.layout.stacked:
                pieces = 2 * param.shape[0]
            elif key.endswith(".experts.down_proj") and not self.layout.stacked:
                pieces = param.shape[0]
            got = self.written.get(key, 0)
            if got != pieces:
                problems.append(f"{key} ({got} of {pieces} pieces)")
        self.written.clear()
        if problems:
            shown = ", ".join(problems[:4]) + (f" and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise ValueError(f"weight push left transformers parameters unwritten or written twice: {shown}")
