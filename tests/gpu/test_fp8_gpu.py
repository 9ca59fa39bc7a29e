"""FP8 through Transformer Engine on a real GPU, and NVML telemetry (skipped without CUDA).

The FP8 check runs one tiny Qwen3-MoE-style model (TE layer spec, BF16 weights) twice on
the same tokens: with ``TransformerConfig.fp8`` cleared (BF16) and set (each recipe this GPU
runs, as decided by ``megatron_rl.fp8.validate_fp8``), and compares next-token log-probs.

Stated bound (random-init model, 2 x 128 tokens, vocab 256, log-probs spread ~0.3 nats
around -ln 256): mean |FP8 - BF16| <= 0.05 nats, max <= 0.5 nats, Pearson correlation
>= 0.95, and the difference is not exactly 0 (FP8 kernels really ran). The router and the
output layer must stay out of FP8: router logits in fp32, output layer a Megatron (non-TE)
linear fed BF16 activations. Run with ``pytest -s tests/gpu`` to see the measured figures.
"""

import contextlib

import pytest
import torch

from megatron_rl.config_loading import ConfigError
from megatron_rl.fp8 import (
    FP8Config,
    detect_fp8_environment,
    fp8_autocast,
    transformer_config_fields,
    validate_fp8,
)
from megatron_rl.sections import ModelConfig, ParallelConfig
from megatron_rl.telemetry import GpuTelemetry

pytestmark = pytest.mark.gpu

MEAN_BOUND, MAX_BOUND, MIN_CORRELATION = 0.05, 0.5, 0.95
RECIPES = [
    FP8Config(enabled=True, recipe="delayed", amax_history_len=16),
    FP8Config(enabled=True, recipe="tensorwise"),
    FP8Config(enabled=True, recipe="blockwise", format="e4m3"),
    FP8Config(enabled=True, recipe="mxfp8", format="e4m3"),
]
# Every GEMM dimension a multiple of 128, as blockwise and MXFP8 scaling want.
TINY = ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   head_dim=64, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
                   max_position_embeddings=256, params_dtype="bfloat16")


def _runnable(cfg):
    """Skip a recipe this machine cannot run (the same rule the config check applies)."""
    env = detect_fp8_environment()
    if env.te_version is None:
        pytest.skip("Transformer Engine does not import here")
    try:
        validate_fp8(cfg, env)
    except ConfigError as err:
        pytest.skip(str(err))


@contextlib.contextmanager
def _bf16(model):
    """Run the FP8-configured model in BF16: Megatron reads ``config.fp8`` at every forward."""
    saved = model.config.fp8
    model.config.fp8 = None
    try:
        yield
    finally:
        model.config.fp8 = saved


def _next_token_logprobs(model, ids):
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).flatten()


@pytest.mark.parametrize("cfg", RECIPES, ids=[c.recipe for c in RECIPES])
def test_fp8_logprobs_stay_close_to_bf16(cfg, one_gpu_world):
    _runnable(cfg)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.parallel.model import build_model

    model = build_model(TINY, ParallelConfig(), use_te=True, moe_grouped_gemm=True,
                        **transformer_config_fields(cfg)).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, TINY.vocab_size, (2, 128), device="cuda", generator=gen)

    router_dtypes, output_inputs = [], []
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        def gating(inp, _orig=router.gating):
            logits = _orig(inp)
            router_dtypes.append(logits.dtype)
            return logits
        router.gating = gating
    model.output_layer.register_forward_hook(lambda mod, args, out: output_inputs.append(args[0].dtype))

    with _bf16(model):
        bf16_a, bf16_b = _next_token_logprobs(model, ids), _next_token_logprobs(model, ids)
    for _ in range(2):  # delayed scaling needs amax history before its scales fit
        _next_token_logprobs(model, ids)
    fp8 = _next_token_logprobs(model, ids)

    diff = (fp8 - bf16_a).abs()
    corr = torch.corrcoef(torch.stack([fp8, bf16_a]))[0, 1].item()
    print(f"\n{cfg.recipe}/{cfg.format}: |FP8 - BF16| log-prob mean {diff.mean():.5f} max {diff.max():.5f} "
          f"corr {corr:.5f} over {diff.numel()} tokens (BF16 log-prob std {bf16_a.std():.4f})")
    assert torch.equal(bf16_a, bf16_b), "the BF16 reference is not deterministic"
    assert diff.max() > 0, "FP8 gave bit-identical log-probs: the FP8 path did not run"
    assert diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND and corr >= MIN_CORRELATION
    assert router_dtypes and set(router_dtypes) == {torch.float32}
    assert type(model.output_layer) is ColumnParallelLinear and set(output_inputs) == {torch.bfloat16}


@pytest.mark.parametrize("cfg", RECIPES, ids=[c.recipe for c in RECIPES])
def test_fp8_autocast_runs_a_te_linear(cfg):
    _runnable(cfg)
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = layer(x).float()
        for _ in range(3):
            with fp8_autocast(cfg):
                out = layer(x).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"\n{cfg.recipe}: te.Linear relative error FP8 vs BF16 {rel:.4f}")
    assert 0 < rel < 0.1


def test_telemetry_reads_this_gpu():
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB in use for sure
    lines = []
    with GpuTelemetry(log=lines.append) as tel:
        values = tel.sample()
    del block
    print(f"\ntelemetry: {values}")
    assert lines == [] and tel.sample() == {}
    index = torch.cuda.current_device()
    for name in ("mem_used_gib", "mem_total_gib", "util_pct", "power_w", "temp_c"):
        assert f"gpu{index}/{name}" in values, name
    assert 1.0 <= values[f"gpu{index}/mem_used_gib"] <= values[f"gpu{index}/mem_total_gib"]
    assert 0.0 <= values[f"gpu{index}/util_pct"] <= 100.0
    assert values[f"gpu{index}/power_w"] > 0.0 and 0.0 < values[f"gpu{index}/temp_c"] < 120.0
