"""The CPU stand-in's engine: a Megatron model in a world of one, its generator, its served weights.

Builds the config's model on one dedicated thread (the CPU platform and the parallel state
live there; every Megatron call runs on it), a generator over it (the HF engine, a
transformers replica with its own numerics, refreshed when a weight-update session ends;
or the Megatron model itself, exact), and :class:`~megatron_rl.sglang_standin.
weights.ServedWeights`, which writes pushed HF tensors into the model by SGLang's
loader rules. Joins weight-update groups (gloo) and receives their broadcasts. Frees and
re-allocates the served weights when the server releases and resumes them (colocated runs,
:mod:`~megatron_rl.sglang_standin.memory`). Does not own HTTP or SGLang's request
rules (:mod:`~megatron_rl.sglang_standin.server`).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.parallel.comm import broadcast
from megatron_rl.parallel.offload import StorageSet
from megatron_rl.sglang_standin.weights import (
    ServedWeights,
    flat_receive_layout,
)
from megatron_rl.rollout.sglang.weight_payload import FLATTENED_BUCKET
from megatron_rl.sections import ModelConfig, ParallelConfig


class EngineHost:
    """A local engine over a Megatron model in a world of one, driven from one dedicated thread.

    Args:
        model_cfg: architecture to build.
        architecture: HF ``model_type`` served (names of pushed tensors, loader rules).
        seed: initial weights.
        micro_batch_sequences: sequences per forward micro-batch (megatron engine).
        engine: hf (a transformers replica generates; Qwen3-MoE, Mixtral), megatron (the model
            itself), or auto (hf when it can serve the architecture).
        logprobs_after_temperature: report ``log_softmax(logits / T)`` (SGLang's default).
        checkpoint: weights served from the start (SGLang's ``--model-path``), else random ones
            from ``seed`` until the first push.
    """

    def __init__(self, model_cfg: ModelConfig, architecture: str, seed: int, micro_batch_sequences: int = 64,
                 engine: Literal["auto", "hf", "megatron"] = "auto", logprobs_after_temperature: bool = False,
                 checkpoint: str | None = None) -> None:
        from megatron_rl.rollout.local.hf_model import EXPERT_LAYOUTS

        if engine not in ("auto", "hf", "megatron"):
            raise ValueError(f"engine must be auto, hf or megatron, got {engine!r}")
        self.model_cfg, self.architecture = model_cfg, architecture
        self.engine_kind = engine if engine != "auto" else ("hf" if architecture in EXPERT_LAYOUTS else "megatron")
        self.logprobs_after_temperature = logprobs_after_temperature
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._stack = contextlib.ExitStack()
        self._executor.submit(self._start, seed, micro_batch_sequences, checkpoint).result()
        self.update_groups: dict[str, dist.ProcessGroup] = {}
        self.released: StorageSet | None = None
        """The served model's weights while released."""
        self.backup = False
        """Their bytes were kept (``--enable-weights-cpu-backup``)."""

    def _start(self, seed: int, micro_batch_sequences: int, checkpoint: str | None) -> None:
        from megatron_rl.checkpoint.megatron_io import named_weights
        from megatron_rl.parallel.cpu_platform import cpu_platform
        from megatron_rl.parallel.groups import model_parallel
        from megatron_rl.parallel.model import build_model
        from megatron_rl.parallel.world import world_of_one
        from megatron_rl.rollout.local.embedded import EmbeddedEngine

        # The CPU platform's device rewriting is a thread-local torch mode: it must be
        # entered on the thread that runs every forward.
        self._stack.enter_context(world_of_one())
        self._stack.enter_context(cpu_platform())
        groups = self._stack.enter_context(model_parallel(ParallelConfig(), seed))
        self.groups = groups
        self.model = build_model(self.model_cfg, ParallelConfig(), moe_enable_routing_replay=True)
        if checkpoint is not None:
            from megatron_rl.checkpoint.init_source import inspect_init_checkpoint
            from megatron_rl.train.init_weights import load_initial_weights

            load_initial_weights(self.model, inspect_init_checkpoint(checkpoint), self.model_cfg, groups)
        self.model.eval()
        self.weights = ServedWeights(named_weights(self.model), self.model_cfg, self.architecture)
        if self.engine_kind == "hf":
            from megatron_rl.rollout.local.hf_engine import HFEngine

            self.engine = HFEngine(self.model, groups, architecture=self.architecture, model_config=self.model_cfg,
                                   logprobs_after_temperature=self.logprobs_after_temperature)
        else:
            self.engine = EmbeddedEngine(self.model, groups, micro_batch_sequences,
                                         logprobs_after_temperature=self.logprobs_after_temperature)

    async def call(self, fn, *args):
        """Run ``fn(*args)`` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def refresh(self) -> None:
        """After a weight-update session: the HF replica follows the model (SGLang post-processes
        its weights at ``end_weight_update`` too)."""
        if self.engine_kind == "hf":
            self.engine.update_weights(self.engine.weight_version + 1)

    def release_weights(self, backup: bool) -> None:
        """Free the served weights (the model's parameters, and the HF replica's); ``backup``:
        keep a host copy (``--enable-weights-cpu-backup``). The model's buffers stay, as SGLang
        stashes and restores them."""
        self.released, self.backup = StorageSet((p, backup) for p in self.model.parameters()), backup
        self.released.offload()
        if self.engine_kind == "hf":
            self.engine.release_memory()

    def resume_weights(self) -> None:
        """Map the served weights again: as they were with a backup, else NaN (SGLang's are
        undefined until the next push)."""
        self.released.restore()
        self.released = None
        if self.engine_kind == "hf":
            self.engine.resume_memory()
        if self.backup:
            if self.engine_kind == "hf":
                self.refresh()  # the replica is rebuilt from the kept weights
            return
        replica = self.engine.hf_model.parameters() if self.engine_kind == "hf" else ()
        with torch.no_grad():
            for p in [*self.model.parameters(), *replica]:
                p.fill_(float("nan"))

    def receive(self, group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive a bucket broadcast by the trainer's rank 0: one buffer (a flattened bucket), or
        one tensor at a time in order.

        Raises:
            ValueError: a flattened bucket SGLang refuses (before joining the broadcast).
        """
        if load_format == FLATTENED_BUCKET:
            layout = flat_receive_layout(names, dtypes, shapes)
            flat = torch.empty(layout[-1][-1], dtype=torch.uint8)
            broadcast(flat, 0, group)
            return [(name, flat[start:end].view(dtype).reshape(shape)) for name, dtype, shape, start, end in layout]
        named = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast(tensor, 0, group)
            named.append((name, tensor))
        return named

    def close(self) -> None:
        """Leave the world and stop the thread."""
        self._executor.submit(self._stack.close).result()
        self._executor.shutdown()
