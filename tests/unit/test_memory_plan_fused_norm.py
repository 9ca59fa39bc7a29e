"""The planner's activations on a GPU target against what torch's fused RMSNorm keeps.

On CUDA, ``torch.nn.RMSNorm`` runs ``aten::_fused_rms_norm``, which has a CUDA kernel in torch's
``native_functions.yaml``, so autograd records the node that ``derivatives.yaml`` declares for
it: its backward reads ``input``, ``result1`` (rstd) and ``weight``. On CPU the op has only its
composite (fp32 copies: what the CPU-validated formulas count,
``tests/parallel/test_memory_plan_model.py``). Registering torch's own decompositions of the
forward and backward as CPU kernels (``torch._decomp``) makes a CPU run record that same node, so
the bytes each decoder layer of the real model saves on a GPU are counted here, and compared with
``layer_bytes`` for the shape the planner builds for a GPU machine.

The first real GPU run (H200, torch 2.11) measured the over-count this removes: 0.147 GiB per 1K
tokens on the 0.5B made model of ``tools/gpu_check_steps/planner.py`` (docs/memory.md).
"""

import contextlib
import dataclasses
from pathlib import Path

import torch
import torchgen
import yaml
from saved_bytes import saved_per_layer

from megatron_rl.parallel.world import world_of_one
from megatron_rl.plan.activations import layer_bytes
from megatron_rl.plan.machine import GIB, Machine
from megatron_rl.plan.phases import rank_shape
from megatron_rl.sections import ModelConfig, ParallelConfig

MODEL = ModelConfig(vocab_size=512, num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=4,
                    head_dim=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96)
"""qk norms and GQA (the k norm's input is a view of the fused qkv output)."""
MODELS = {"bf16": dataclasses.replace(MODEL, params_dtype="bfloat16"), "fp32": MODEL}
TOKENS = 256
"""One micro-batch: 4 samples of 64 tokens, the budget exactly."""
GPU = Machine(gpus=1, gpu_memory=80 * GIB)


def _torch_entry(path: str, key: str) -> dict:
    """The entry of the installed torch's declaration file ``path`` whose ``key`` starts with
    ``_fused_rms_norm(`` (its block alone is parsed: the whole file takes seconds)."""
    text = (Path(torchgen.__file__).parent / "packaged" / path).read_text()
    start = text.index(f"- {key}: _fused_rms_norm(")
    end = text.find("\n- ", start + 1)
    (entry,) = yaml.safe_load(text[start:end])
    return entry


def test_torch_runs_the_fused_rms_norm_on_cuda_keeping_its_input_and_rstd():
    """The facts the GPU formula rests on, read from the installed torch's own declarations."""
    native = _torch_entry("ATen/native/native_functions.yaml", "func")
    assert "CUDA" in native["dispatch"] and "CPU" not in native["dispatch"]
    assert "CompositeImplicitAutograd" in native["dispatch"]  # CPU: the composite, fp32 copies
    derivative = _torch_entry("autograd/derivatives.yaml", "name")
    assert "_fused_rms_norm_backward(grads[0], input, normalized_shape, result1, weight," in derivative["input, weight"]
    with _fused_rms_norm_on_cpu():  # nn.RMSNorm goes through the op (torch's rms_norm_symint)
        out = torch.nn.RMSNorm(8, dtype=torch.bfloat16)(torch.ones(2, 8, dtype=torch.bfloat16, requires_grad=True))
    assert type(out.grad_fn).__name__ == "FusedRmsNormBackward0"


@contextlib.contextmanager
def _fused_rms_norm_on_cpu():
    """CPU kernels for the fused op and its backward (torch's decompositions): autograd then
    records the node CUDA records."""
    from torch._decomp import decompositions

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_fused_rms_norm", decompositions._fused_rms_norm, "CPU")
        library.impl("_fused_rms_norm_backward", decompositions._fused_rms_norm_backward, "CPU")
        yield
    finally:
        library._destroy()


def _saved_per_layer(model_cfg, groups) -> dict[int, int]:
    """Bytes saved for backward inside each decoder layer in one update (unique storages,
    parameters excluded), with ``tests/saved_bytes.py``."""
    from megatron_rl.algos.presets import get_preset
    from megatron_rl.parallel.model import build_model
    from megatron_rl.parallel.schedule import wrap_for_training
    from megatron_rl.parallel.train_step import RoutingPlan, TrainBatch, forward_backward

    model = build_model(model_cfg, ParallelConfig())
    ddp = wrap_for_training(model)

    gen = torch.Generator().manual_seed(0)
    responses = 4 * (TOKENS // 4 - 16)
    batch = TrainBatch(sequences=[torch.randint(0, model_cfg.vocab_size, (TOKENS // 4,), generator=gen)
                                  for _ in range(4)],
                       prompt_lengths=[16] * 4, old_logprobs_T=torch.full((responses,), -5.0),
                       advantages_T=torch.randn(responses, generator=gen))
    return saved_per_layer(model, lambda: forward_backward(
        ddp, groups, batch, get_preset("dr_grpo"), RoutingPlan(mode="none", diagnostics=False),
        micro_batch_tokens=TOKENS))


def test_gpu_layer_bytes_equal_what_the_fused_norm_layers_save():
    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel

    # A world of this process alone (a spawned one costs ten times the counting), torn down on exit.
    with world_of_one(), cpu_platform(), model_parallel(ParallelConfig(), seed=1) as groups, _fused_rms_norm_on_cpu():
        saved = {name: _saved_per_layer(model_cfg, groups) for name, model_cfg in MODELS.items()}
    for name, model_cfg in MODELS.items():
        shape = rank_shape(model_cfg, ParallelConfig(), GPU, TOKENS)
        assert saved[name] == {i: layer_bytes(model_cfg, shape, i) for i in range(model_cfg.num_layers)}, name
