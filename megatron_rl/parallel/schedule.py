"""Forward (and backward) over packed micro-batches through Megatron's pipeline schedules.

Owns: wrapping a model stage for gradient reduction (Megatron DDP + ``finalize_model_grads``)
and driving ``get_forward_backward_func()`` with packed micro-batches, so every layout
(TP+SP, EP, PP and combinations) runs through Megatron's own schedule code. The loss is a
per-token sum with the token count reported to Megatron (``calculate_per_token_loss``), so
gradients equal the gradient of the global token mean whatever the micro-batching, data
parallelism or pipeline split. Under context parallelism each rank feeds the model its share
of every row (``PackedMicroBatch.model_inputs``) with the whole row's ``PackedSeqParams``. Does not own the loss math: callers pass ``loss_fn``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.parallel.packing import PackedMicroBatch
from megatron_rl.sections import OptimConfig

# loss_fn(micro_batch, logits_1TV_local) -> (loss_sum scalar, num_tokens int tensor, dict)
LossFn = Callable[[PackedMicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]


def wrap_for_training(model: torch.nn.Module, optim: OptimConfig | None = None) -> DistributedDataParallel:
    """Wrap a stage in Megatron DDP so gradients land in ``param.main_grad`` and reduce.

    ``optim`` (default: the plain optimizer) decides the buffers: with ``optim.distributed``
    DDP keeps the parameters in one buffer per dtype and reduce-scatters the gradients, for
    Megatron's distributed optimizer (build it with the same ``optim``). With
    ``optim.overlap_grad_reduce`` the reduce-scatter of each bucket starts during the
    backward pass; the schedule is then told how to hold it back until a step's last
    micro-batch (``no_sync_func``, ``grad_sync_func``, as Megatron-LM's training loop sets
    them). Without them every micro-batch's backward counts as the last: a bucket is reduced
    once the first step's count of gradients arrives, and when the number of micro-batches
    changes between steps (token-budget packing) it is reduced before the last ones arrive,
    silently wrong.
    """
    optim = optim or OptimConfig()
    config = model.config
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    reduction = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=optim.overlap_param_gather,
        use_distributed_optimizer=optim.distributed,
        bucket_size=optim.bucket_size,
        # Sum over DP; finalize_model_grads divides by the global token count.
        average_in_collective=False,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=reduction, module=model)
    if optim.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    return ddp


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare GPTModel inside DDP (or the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[PackedMicroBatch],
    loss_fn: LossFn,
    forward_only: bool,
    before_forward: Callable[[int], None] | None = None,
) -> list[dict]:
    """Run the micro-batches through Megatron's schedule for this rank's layout.

    Args:
        model: the stage (DDP-wrapped when ``forward_only`` is False).
        micro_batches: this data-parallel rank's micro-batches, in order.
        loss_fn: per-micro-batch loss on the last stage.
        forward_only: skip the backward pass and gradient reduction.
        before_forward: called with the micro-batch index right before its forward
            (routing replay hands the routers that micro-batch's experts here).

    Returns:
        On the last pipeline stage, the dicts returned by ``loss_fn`` in micro-batch order;
        an empty list on other stages. Under context parallelism ``loss_fn`` sees the logits
        of this CP rank's rows (``PackedMicroBatch.local_rows``).
    """
    if not micro_batches:
        raise ValueError("run_schedule: no micro-batches for this rank")
    config = unwrap(model).config
    config.calculate_per_token_loss = True
    if not forward_only and not isinstance(model, DistributedDataParallel):
        raise TypeError("run_schedule: wrap the model with wrap_for_training() to train")

    def forward_step(data_iterator: Iterable[tuple[int, PackedMicroBatch]], stage: torch.nn.Module):
        index, mb = next(data_iterator)
        if before_forward is not None:
            before_forward(index)
        # This rank's share of the row (all of it without context parallelism).
        output = stage(**mb.model_inputs(next(stage.parameters()).device))

        def loss_func(output_tensor: torch.Tensor):
            return loss_fn(mb, output_tensor)

        return output, loss_func

    if not forward_only:
        # Megatron's FP32 optimizer step leaves ``param.grad`` aliasing ``param.main_grad``.
        # A backward through that alias adds the gradient into main_grad twice (autograd's
        # accumulation, then DDP's hook adds param.grad again), so drop it as Megatron's own
        # train_step does with ``optimizer.zero_grad()`` next to ``zero_grad_buffer()``.
        model.zero_grad(set_to_none=True)
        model.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(enumerate(micro_batches)),
        model=[model],
        num_microbatches=len(micro_batches),
        # The whole row: Megatron divides it by CP (and by TP under SP) for the stage shapes.
        seq_length=max(mb.padded_length for mb in micro_batches),
        micro_batch_size=1,
        forward_only=forward_only,
    )
