"""The batches generated ahead in a checkpoint: written whole, and restored, regenerated or given back.

Layout inside ``<checkpoint>``::

    rollouts/batches.json        rank 0: each batch's step and data positions, the data-parallel size
    rollouts/rank_NNNNN.pt       each rank's samples of every batch (tokens, per-token versions,
                                 log-probs, routes), with the ids of the prompts they answer

Written before the checkpoint is published (:meth:`AsyncRollouts.settle` first: every batch
whole), so a checkpoint either holds its batches or does not count. A resumed run with
``max_staleness`` > 0 and the same data-parallel size gets them back as they were; a batch
whose samples would train more than ``max_staleness`` versions old (a checkpoint of a deeper
pipeline) is asked again under the current weights (``rollout.stale_samples: regenerate``)
or dropped, its groups counted (``drop``: the step draws fresh prompts). A run that cannot
take them (synchronous, or another data-parallel size) gives their prompts back: the data
position is rewound to the first one, which is exact when the batches are the last prompts
drawn (always without dynamic sampling, and with k = 1); otherwise it is refused, naming
what to set. Checkpoints of k = 1 runs before this layout (``batch.json``) read as one batch.

Owns the files; not the buffer itself (:mod:`megatron_rl.train.async_rollouts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_rl.parallel.comm import all_reduce, max_over
from megatron_rl.parallel.comm import rank as rank_in
from megatron_rl.train.async_rollouts import AsyncRollouts, NextBatch, ScoreAhead

if TYPE_CHECKING:
    from megatron_rl.train.async_rollouts import RoundSource
    from megatron_rl.train.checkpoint import TrainerState


def rank_file(checkpoint: Path, rank: int) -> Path:
    """Where the rank ``rank`` of the world keeps its samples of the batches in ``checkpoint``."""
    return Path(checkpoint) / "rollouts" / f"rank_{rank:05d}.pt"


def save_batches(ahead: AsyncRollouts, checkpoint: Path, state: TrainerState) -> None:
    """Write the generated batches (every one joined: :meth:`AsyncRollouts.settle` first) into
    ``checkpoint`` before it is published. Every rank calls it (``save_checkpoint``'s ``write_more``)."""
    groups = ahead.source.groups
    if any(batch.samples is None for batch in ahead.ahead):
        raise RuntimeError("a checkpoint of batches still in flight: settle first")
    rank = rank_in(groups.world)
    (Path(checkpoint) / "rollouts").mkdir(parents=True, exist_ok=True)
    torch.save({"batches": [{"samples": b.samples, "sample_ids": [p.sample_id for p in b.problems]}
                            for b in ahead.ahead]}, rank_file(checkpoint, rank))
    if rank == 0:
        about = [{"step": b.step, "start": b.start, "end": b.end, "dp_size": groups.dp_size} for b in ahead.ahead]
        (Path(checkpoint) / "rollouts" / "batches.json").write_text(
            json.dumps({"saved_at_step": state.step, "batches": about}))


def _saved(checkpoint: Path, rank: int) -> tuple[list[dict], list[dict]]:
    """``(about, per-rank contents)`` of the saved batches, either layout."""
    root = Path(checkpoint) / "rollouts"
    if (root / "batches.json").exists():
        about = json.loads((root / "batches.json").read_text())["batches"]
        return about, (torch.load(rank_file(checkpoint, rank), weights_only=False)["batches"] if about else [])
    one = json.loads((root / "batch.json").read_text())["batch"]
    if one is None:
        return [], []
    return [one], [torch.load(rank_file(checkpoint, rank), weights_only=False)]


def resume_batches(source: RoundSource, checkpoint: Path, state: TrainerState, ahead: AsyncRollouts | None,
                   stale_policy: str = "drop") -> None:
    """Put the batches ``checkpoint`` holds for its next steps back into ``ahead`` (collective
    over the world), regenerated or dropped when too old to train, or give their prompts back
    (see the module docstring)."""
    saved_cfg = json.loads((Path(checkpoint) / "trainer_state.json").read_text())["config"]
    if saved_cfg.get("rollout", {}).get("max_staleness", 0) == 0:
        return  # files a run before it left in the same directory are never read
    rank = rank_in(source.groups.world)
    about, contents = _saved(checkpoint, rank)
    if not about:
        return
    if ahead is None or about[0]["dp_size"] != source.groups.dp_size:
        _give_back(checkpoint, about, state, rank)
        return
    for info, content in zip(about, contents):
        problems = source.problems_at(info["start"], info["end"])
        if [p.sample_id for p in problems] != content["sample_ids"]:
            raise RuntimeError(f"{rank_file(checkpoint, rank)}: the saved rollouts of step {info['step']} answer other "
                               f"prompts than the training order gives at positions {info['start']}..{info['end']} "
                               "(the data changed since)")
        oldest = min((s.weight_version for s in content["samples"]), default=state.weight_version)
        age = max_over(torch.tensor([float(info["step"] - 1 - oldest)]), source.groups.dp)[0]
        if age <= ahead.k:
            ahead.ahead.append(NextBatch(info["step"], info["start"], info["end"], problems, None, content["samples"]))
        elif stale_policy == "regenerate":
            scoring = ScoreAhead(source, source.per_sample(problems))
            pending = source.start_generate(problems, info["step"], 1, on_samples=scoring)
            ahead.ahead.append(NextBatch(info["step"], info["start"], info["end"], problems, pending, scoring=scoring))
        else:
            dropped = torch.tensor([float(len(problems))])
            all_reduce(dropped, source.groups.dp)
            ahead.stale_dropped += int(dropped[0])
            if rank == 0:
                print(f"{Path(checkpoint).name}: the rollouts generated ahead for step {info['step']} would train "
                      f"{int(age)} versions old (rollout.max_staleness {ahead.k}): {int(dropped[0])} groups dropped",
                      flush=True)


def _give_back(checkpoint: Path, about: list[dict], state: TrainerState, rank: int) -> None:
    """Rewind the data position to the first saved batch's prompts, when they are the last drawn."""
    contiguous = all(a["end"] == b["start"] for a, b in zip(about, about[1:])) and about[-1]["end"] == state.data_position
    steps = ", ".join(str(a["step"]) for a in about)
    if not contiguous:
        raise RuntimeError(f"{Path(checkpoint).name} holds rollouts generated ahead for steps {steps} between which other "
                           "prompts were drawn (dynamic sampling): resume it with the same rollout.max_staleness > 0 and "
                           "data-parallel size, or from an earlier checkpoint")
    state.data_position = about[0]["start"]
    if rank == 0:
        print(f"{Path(checkpoint).name}: the rollouts generated ahead for steps {steps} are not used (this run is "
              "synchronous or has another data-parallel size); their prompts are drawn again", flush=True)
