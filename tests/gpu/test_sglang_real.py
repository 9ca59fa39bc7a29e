"""A real SGLang server against the Megatron pass (needs CUDA and SGLang; skipped otherwise).

Starts ``sglang.launch_server`` (the protocol of SGLang 0.5.23) through
:class:`~megatron_rl.rollout.sglang.server.SGLangServer` (so with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1``) on a tiny Qwen3-MoE checkpoint written by transformers,
replaces its weights with a Megatron model's through
:class:`~megatron_rl.rollout.sglang.weight_sync.WeightSync` by the same protocol the CPU suite
holds the stand-in to: ``/server_info``'s ``tp_size`` checked, one weight-update session
(``/begin_weight_update`` ... ``/end_weight_update``), colocated ``/update_weights_from_tensor``
with one entry per TP rank of CUDA IPC handles naming the GPU by UUID, HF names from the
conversion table; then samples with the real client at T = 0.7 (the log-prob convention is
probed first) and compares each generated token's served log-prob and each position's routed
experts with Megatron's own log-prob pass over the same sequences.

SGLang may live in its own environment (it pins another torch): point
``MEGATRON_RL_SGLANG_PYTHON`` at that interpreter; by default this interpreter is used.
Stated bounds (BF16 both sides, random init with decisive routers; raw ``log_softmax`` on both
sides at T = 0.7): mean |served - Megatron| <= 0.05 nats,
max <= 0.5; routed expert sets agree on >= 0.95 of (position, layer) pairs (BF16
near-ties may flip a few). Run ``pytest -s tests/gpu/test_sglang_real.py`` for the figures.
"""

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from ports import PortTaken, on_a_fresh_port, was_taken

from megatron_rl.sections import ModelConfig, ParallelConfig

pytestmark = pytest.mark.gpu

SGLANG_PYTHON = os.environ.get("MEGATRON_RL_SGLANG_PYTHON", sys.executable)
MEAN_BOUND, MAX_BOUND, ROUTE_AGREEMENT = 0.05, 0.5, 0.95
# head_dim 64 and widths of 128+ keep SGLang's attention and fused-MoE kernels on their usual paths.
TINY = ModelConfig(vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   head_dim=64, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                   max_position_embeddings=1024, params_dtype="bfloat16")


def _sglang_version() -> str:
    probe = subprocess.run([SGLANG_PYTHON, "-c", "import sglang; print(sglang.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"sglang is not importable by {SGLANG_PYTHON} (set MEGATRON_RL_SGLANG_PYTHON)")
    return probe.stdout.strip()


def _write_hf_checkpoint(directory) -> None:
    """A random Qwen3-MoE checkpoint of TINY's shape for the server to start from."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_rl.checkpoint.hf_config import hf_config_from_model

    config = Qwen3MoeConfig(**hf_config_from_model("qwen3_moe", TINY))
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


@contextlib.contextmanager
def _sglang_on_a_fresh_port(cfg, log):
    """A healthy SGLang server; SGLang takes a port number only, so one taken before it bound it
    means a fresh port."""
    from megatron_rl.rollout.sglang.server import SGLangServer, ServerStartError

    def start(port):
        server = SGLangServer(dataclasses.replace(cfg, port=port), log_path=log)
        try:
            return server.__enter__()
        except ServerStartError as err:
            if was_taken(str(err)):
                raise PortTaken(str(err)) from None
            raise

    server = on_a_fresh_port(start)
    try:
        yield server
    finally:
        server.stop()


def test_real_sglang_serves_the_megatron_weights(one_gpu_world, tmp_path):
    from megatron_rl.parallel.logprobs import compute_logprobs
    from megatron_rl.parallel.model import build_model
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.sglang.client import SGLangClientConfig
    from megatron_rl.rollout.sglang.server import SGLangServerConfig
    from megatron_rl.rollout.sglang.weight_sync import WeightSyncConfig, sglang_engine

    version = _sglang_version()
    groups = one_gpu_world
    # The local spec: the conversion table speaks its parameter names (TE fuses the norms).
    model = build_model(TINY, ParallelConfig(), use_te=False, moe_enable_routing_replay=True).cuda().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):
                param.mul_(10)  # decisive routers: BF16 rounding should not flip top-K
    _write_hf_checkpoint(tmp_path / "hf")
    server_cfg = SGLangServerConfig(model_path=str(tmp_path / "hf"), host="127.0.0.1", port=0,
                                    mem_fraction_static=0.3, weight_version="init", python=SGLANG_PYTHON,
                                    extra_args=["--disable-cuda-graph"])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, TINY.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 40, (16,), generator=gen)]
    params = SamplingParams(temperature=0.7, max_new_tokens=24)
    with _sglang_on_a_fresh_port(server_cfg, tmp_path / "sglang.log") as server:
        engine = sglang_engine(model, groups, SGLangClientConfig(urls=[server.url], max_retries=1),
                               WeightSyncConfig(mode="tensor", bucket_bytes=1 << 20),
                               architecture="qwen3_moe", model_config=TINY)
        engine.update_weights(1)
        samples = engine.generate(prompts, params, return_routed_experts=True, seed=0)
        assert engine.convention_checked and engine.server_info[server.url]["tp_size"] == 1
    ours = compute_logprobs(model, groups, [s.tokens for s in samples], [len(p) for p in prompts],
                            record_routing=True)
    served = torch.cat([s.output_logprobs for s in samples])
    diff = (ours.logprobs_T.cpu() - served).abs()
    agree = torch.cat([
        (ours.record.sample(i).expert_ids_TLK[:-1].cpu().long().sort(-1).values
         == s.routed_experts.long().sort(-1).values).all(-1).flatten()
        for i, s in enumerate(samples)
    ]).float().mean()
    print(f"\nSGLang {version}: {served.numel()} tokens, |served - Megatron| log-prob mean {diff.mean():.4f} "
          f"max {diff.max():.4f}; routed-expert agreement {agree:.4f}")
    assert {s.weight_version for s in samples} == {1}
    assert all(s.routed_experts.shape == (len(s.tokens) - 1, TINY.num_layers, TINY.moe_router_topk) for s in samples)
    assert diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND
    assert agree >= ROUTE_AGREEMENT
