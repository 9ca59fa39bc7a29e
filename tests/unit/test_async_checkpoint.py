"""The batch generated ahead in a checkpoint: kept whole, or its prompts given back.

A stand-in of the rollouts (data-parallel size, the training order) is enough:
:func:`resume_batch` and :meth:`AsyncRollouts.save` only read those, and the rank.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.train import async_rollouts
from megatron_rl.train.async_rollouts import AsyncRollouts, NextBatch, resume_batch
from megatron_rl.train.checkpoint import TrainerState


def _source(dp_size: int = 2, dp_rank: int = 0, name: str = "p"):
    """The rollouts of a run with ``dp_size`` data-parallel ranks, seen from ``dp_rank``."""
    return SimpleNamespace(
        groups=SimpleNamespace(dp_size=dp_size, world=None), engine=None,
        problems_at=lambda start, end: [SimpleNamespace(sample_id=f"{name}{p}") for p in range(start, end)][
            dp_rank::dp_size],
    )


def _sample(i: int, version: int) -> RolloutSample:
    return RolloutSample(prompt_ids=[1, 2, i], output_ids=[3, i], output_logprobs=torch.tensor([-0.5, -0.25 * i]),
                         finish_reason="stop", weight_version=version,
                         routed_experts=torch.tensor([[[i, 1]]] * 4, dtype=torch.uint8))


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A checkpoint saved at step 2 by a max_staleness 1 run, with step 3's batch (positions 8..12)."""
    monkeypatch.setattr(async_rollouts, "rank_in", lambda group: 0)
    path = tmp_path / "step_000002"
    path.mkdir()
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"rollout": {"max_staleness": 1}}}))
    ahead = AsyncRollouts(_source())
    problems = [SimpleNamespace(sample_id="p8"), SimpleNamespace(sample_id="p10")]
    ahead.next = NextBatch(3, 8, 12, problems, None, [_sample(i, 1) for i in range(4)])
    ahead.save(path, TrainerState(step=2, data_position=12, weight_version=2))
    return path


def test_the_batch_resumes_whole(checkpoint):
    state = TrainerState(step=2, data_position=12, weight_version=2)
    batch = resume_batch(_source(), checkpoint, state, asynchronous=True)
    assert state.data_position == 12 and (batch.step, batch.start, batch.end) == (3, 8, 12)
    assert [p.sample_id for p in batch.problems] == ["p8", "p10"]
    for got, want in zip(batch.samples, [_sample(i, 1) for i in range(4)], strict=True):
        assert got.output_ids == want.output_ids and got.weight_version == 1
        assert torch.equal(got.output_logprobs, want.output_logprobs)
        assert torch.equal(got.routed_experts, want.routed_experts)


@pytest.mark.parametrize("source, asynchronous", [(_source(), False), (_source(dp_size=4), True)],
                         ids=["synchronous", "other dp size"])
def test_a_batch_that_cannot_be_trained_gives_its_prompts_back(checkpoint, source, asynchronous, capsys):
    state = TrainerState(step=2, data_position=12, weight_version=2)
    assert resume_batch(source, checkpoint, state, asynchronous) is None
    assert state.data_position == 8  # positions 8..11 are drawn again: none skipped, none twice
    assert "their prompts are drawn again" in capsys.readouterr().out


def test_files_of_a_synchronous_checkpoint_are_never_read(checkpoint):
    """A synchronous run that saved over the same step left the older rollouts/ behind."""
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"rollout": {}}}))
    state = TrainerState(step=2, data_position=12, weight_version=2)
    assert resume_batch(_source(), checkpoint, state, asynchronous=True) is None and state.data_position == 12


def test_other_prompts_at_the_saved_positions_are_refused(checkpoint):
    with pytest.raises(RuntimeError, match="answer other prompts than the training order gives at positions 8..12"):
        resume_batch(_source(name="q"), checkpoint, TrainerState(step=2, data_position=12, weight_version=2),
                     asynchronous=True)
