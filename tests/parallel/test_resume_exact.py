"""Gradients stay exact across optimizer steps, and a resumed run continues bit for bit.

One single-process world trains a tiny MoE model the way the trainer does: two steps with
a warm-start optimizer, then steps with a second optimizer on the same DDP model, all with
unclipped Adam. Before every optimizer step the gradient Megatron's DDP hands the optimizer
(``param.main_grad``) must equal plain autograd's gradient of the same loss on the bare
module. Checkpoints saved at step 0 (the RL optimizer has not stepped yet, so it holds no
state) and at step 4 must load into freshly built model and optimizer and reproduce the
uninterrupted run's next gradient and update exactly.
"""

import multiprocessing
from pathlib import Path

import pytest
import torch

from megatron_rl.parallel.smoke_worker import random_sequences
from megatron_rl.parallel.world import run_world
from megatron_rl.sections import ModelConfig, OptimConfig, ParallelConfig

pytestmark = pytest.mark.parallel

MODEL = ModelConfig(vocab_size=64, num_layers=2, num_experts=4, moe_router_topk=2)
SEQUENCES = random_sequences(4, MODEL.vocab_size, min_len=6, max_len=16, seed=3)
MICRO_BATCH_SEQUENCES = 2
"""Two micro-batches per step, so accumulation across micro-batches is exercised too."""
WARM_STEPS = (1, 2)
RL_STEPS = (3, 4, 5)
SAVE_STEP = 4


def _loss_fn(mb, logits_1TV):
    """Next-token cross-entropy summed over the real tokens, with their count."""
    from megatron_rl.parallel.packing import next_token_targets

    targets_T, mask_T = next_token_targets(mb)
    logprobs_T = torch.log_softmax(logits_1TV[0].float(), dim=-1).gather(1, targets_T[:, None])[:, 0]
    return -(logprobs_T * mask_T).sum(), mask_T.sum().to(torch.int), {}


def _autograd_gradient(model, micro_batches) -> list[torch.Tensor]:
    """Plain autograd gradient of the token-mean loss, bypassing DDP's buffers and hooks."""
    total, count = 0.0, 0
    for mb in micro_batches:
        logits = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                       packed_seq_params=mb.packed_seq_params())
        loss, tokens, _ = _loss_fn(mb, logits)
        total, count = total + loss, count + int(tokens)
    return list(torch.autograd.grad(total / count, list(model.parameters())))


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    got_flat, want_flat = torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want])
    return float((got_flat - want_flat).norm() / want_flat.norm())


class _Run:
    """A model, its DDP wrapper and the two optimizers the trainer builds on it."""

    def __init__(self):
        from megatron_rl.parallel.model import build_model
        from megatron_rl.parallel.optim import build_optimizer
        from megatron_rl.parallel.schedule import wrap_for_training

        self.model = build_model(MODEL, ParallelConfig())
        self.ddp = wrap_for_training(self.model)
        self.warm_optimizer = build_optimizer(self.ddp, OptimConfig(lr=1e-2, clip_grad=0.0))
        self.optimizer = build_optimizer(self.ddp, OptimConfig(lr=1e-3, clip_grad=0.0))

    def step(self, optimizer, micro_batches) -> dict:
        """Forward-backward, the gradient handed to the optimizer, and the weights after it."""
        from megatron_rl.parallel.optim import optimizer_step
        from megatron_rl.parallel.schedule import run_schedule

        run_schedule(self.ddp, micro_batches, _loss_fn, forward_only=False)
        grads = [p.main_grad.clone() for p in self.model.parameters()]
        optimizer_step(optimizer)
        return {"grads": grads, "weights": [p.detach().clone() for p in self.model.parameters()]}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def resume_worker(run_dir: str) -> dict:
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.parallel.cpu_platform import cpu_platform
    from megatron_rl.parallel.groups import model_parallel
    from megatron_rl.parallel.logprobs import pack_for_rank
    from megatron_rl.train.checkpoint import (
        TrainerState,
        load_checkpoint,
        save_checkpoint,
    )

    out: dict = {"errors": {}}
    with cpu_platform(), model_parallel(ParallelConfig(), seed=1234) as groups:
        micro_batches = pack_for_rank(SEQUENCES, groups, MICRO_BATCH_SEQUENCES)
        run = _Run()
        steps = {}
        for step in WARM_STEPS + RL_STEPS:
            optimizer = run.warm_optimizer if step in WARM_STEPS else run.optimizer
            want = _autograd_gradient(run.model, micro_batches)
            steps[step] = run.step(optimizer, micro_batches)
            out["errors"][step] = _relative_error(steps[step]["grads"], want)
            if step == WARM_STEPS[-1]:
                save_checkpoint(run_dir, run.ddp, run.optimizer, TrainerState(0, 0, 0), {}, groups.world)
            if step == SAVE_STEP:
                save_checkpoint(run_dir, run.ddp, run.optimizer, TrainerState(step, 0, step), {}, groups.world)
        out["processes_left_by_saves"] = [child.name for child in multiprocessing.active_children()]

        resumed = _Run()
        load_checkpoint(Path(run_dir) / "checkpoints" / f"step_{SAVE_STEP:06d}", resumed.ddp, resumed.optimizer,
                        groups.world)
        step = resumed.step(resumed.optimizer, micro_batches)
        out["after_save_grads_equal"] = _same(step["grads"], steps[SAVE_STEP + 1]["grads"])
        out["after_save_weights_equal"] = _same(step["weights"], steps[SAVE_STEP + 1]["weights"])

        try:
            from_zero = _Run()
            load_checkpoint(Path(run_dir) / "checkpoints" / "step_000000", from_zero.ddp, from_zero.optimizer,
                            groups.world)
            step = from_zero.step(from_zero.optimizer, micro_batches)
            out["zero_grads_equal"] = _same(step["grads"], steps[RL_STEPS[0]]["grads"])
            out["zero_weights_equal"] = _same(step["weights"], steps[RL_STEPS[0]]["weights"])
        # Reported to its own test, so the other checks still run; torch's checkpoint errors
        # derive from BaseException.
        except (Exception, CheckpointException) as error:
            out["zero_error"] = repr(error)
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_world(resume_worker, 1, str(tmp_path_factory.mktemp("resume")), timeout_s=300)[0]


def test_gradient_equals_autograd_after_optimizer_steps(result):
    # A gradient accumulated twice is off by 40-100% here; float reordering by ~1e-7.
    assert result["errors"] == pytest.approx({s: 0.0 for s in WARM_STEPS + RL_STEPS}, abs=1e-5), result["errors"]


def test_resumed_run_repeats_next_gradient_and_update_exactly(result):
    assert result["after_save_grads_equal"]
    assert result["after_save_weights_equal"]


def test_resume_from_step_zero_checkpoint_before_first_optimizer_step(result):
    assert "zero_error" not in result, result.get("zero_error")
    assert result["zero_grads_equal"]
    assert result["zero_weights_equal"]


def test_a_synchronous_save_starts_no_process_for_its_write_results(result):
    """Megatron's writer would spawn a Manager process per rank for its results queue (a fresh
    interpreter, 3-4 CPU-s); a synchronous save collects them in this process
    (``mcore_checkpoint.collect_write_results_here``) and the checkpoints above still resume exactly."""
    assert result["processes_left_by_saves"] == []
