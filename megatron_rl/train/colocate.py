"""When the rollout engine gets the weights and the devices: colocated turns or a disaggregated push.

``rollout.placement: disaggregated`` (the default): the engine's memory is its own, so the
trainer pushes its weights whenever they change (after every update) and generation runs
at any time. ``rollout.placement: colocated``: the trainer and the engine take turns on the
same devices. Each generation (a step's rollouts, an evaluation) is one turn, in the order
the memory planner fits (``docs/memory.md``, ``megatron_rl.plan.phases``):

1. the trainer offloads its state: gradient buffers freed, fp32 main weights and optimizer
   state to host memory (``parallel.offload``);
2. the engine resumes its weights: SGLang ``/resume_memory_occupation {"tags": ["weights"]}``,
   the HF engine re-allocates its replica;
3. the trainer pushes its weights: to SGLang in buckets inside one weight-update session
   (CUDA IPC on GPUs, the tensor path on CPU), into the HF replicas by the gather;
4. the trainer offloads its weights (and the KL reference model's);
5. the engine resumes the rest: SGLang's KV cache and CUDA graphs, then generation continues;
6. generation;
7. the engine releases all its memory: SGLang pauses generation and releases every region,
   the HF engine frees its replica and prefix cache;
8. the trainer's state and weights come back, bit for bit.

The engine starts released: SGLang servers release before the model is built
(``train.engines.rollout_urls``), the HF replica right after it is built. A failure inside a
turn ends the run (no clean-up: a collective on one failing rank would hang the others).
Owns the order; not the offload (``parallel.offload``), nor the servers' rules
(``rollout.sglang.memory``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_rl.config import RunConfig
from megatron_rl.parallel.offload import TrainerOffload
from megatron_rl.train.phases import phase_timer

WEIGHTS = ("weights",)
"""What the engine resumes before the push."""
AFTER_PUSH = ("kv_cache", "cuda_graph")
"""What it resumes after the push (SGLang's regions; the HF engine allocates its KV cache per generation)."""


class EngineTurns:
    """The rollout engine's access to the weights and the devices (construct on every rank).

    Args:
        cfg: the run config (``rollout.placement``).
        ddp: the DDP-wrapped policy stage.
        optimizer: its optimizer.
        engine: the rollout engine over ``ddp`` (for colocated runs, SGLang or the HF engine).
    """

    def __init__(self, cfg: RunConfig, ddp: torch.nn.Module, optimizer, engine) -> None:
        self.engine = engine
        self.offload = TrainerOffload(ddp, optimizer) if cfg.rollout.placement == "colocated" else None
        self.version = 0
        """The weight version a colocated turn pushes."""
        if self.offload is not None and cfg.rollout.engine == "hf":
            engine.release_memory()  # built resident, with version 0 pushed

    @property
    def colocated(self) -> bool:
        return self.offload is not None

    def add_frozen(self, module: torch.nn.Module) -> None:
        """A model that goes out with the weights in a colocated turn (the KL reference)."""
        if self.offload is not None:
            self.offload.frozen.append(module)

    def weights_changed(self, version: int) -> None:
        """The policy's weights are now ``version``: pushed at once (disaggregated), or at the
        start of the next turn (colocated: the engine holds no weights in between)."""
        if self.offload is None:
            self.engine.update_weights(version)
        self.version = version

    @contextlib.contextmanager
    def generating(self, metrics: dict | None = None) -> Iterator[None]:
        """A colocated turn around the block (nothing when disaggregated); collective.
        ``metrics``: the step's, which get ``time/offload`` (steps 1-5, the push included, also
        counted in ``time/weight_sync``) and ``time/restore`` (steps 7-8)."""
        if self.offload is None:
            yield
            return
        metrics = {} if metrics is None else metrics
        with phase_timer(metrics, "offload"):
            self.offload.offload("state")
            self.engine.resume_memory(WEIGHTS)
            with phase_timer(metrics, "weight_sync"):
                self.engine.update_weights(self.version)
            self.offload.offload("weights")
            self.engine.resume_memory(AFTER_PUSH)
        yield
        with phase_timer(metrics, "restore"):
            self.engine.release_memory()
            self.offload.restore()
