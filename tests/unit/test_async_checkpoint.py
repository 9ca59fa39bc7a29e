"""The batches generated ahead in a checkpoint: kept whole, regenerated or dropped when too old,
or their prompts given back.

A stand-in of the rollouts (data-parallel size, the training order, background generation) is
enough: :func:`resume_batches` and :func:`save_batches` only read those, and the rank; the
collectives are those of a group of one.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.rollout.engine import RolloutSample
from megatron_rl.train import ahead_checkpoint
from megatron_rl.train.ahead_checkpoint import resume_batches, save_batches
from megatron_rl.train.async_rollouts import AsyncRollouts, NextBatch
from megatron_rl.train.checkpoint import TrainerState


def _source(dp_size: int = 2, dp_rank: int = 0, name: str = "p"):
    """The rollouts of a run with ``dp_size`` data-parallel ranks, seen from ``dp_rank``."""
    started = []
    return SimpleNamespace(
        groups=SimpleNamespace(dp_size=dp_size, world=None, dp=None), engine=None, started=started,
        problems_at=lambda start, end: [SimpleNamespace(sample_id=f"{name}{p}") for p in range(start, end)][
            dp_rank::dp_size],
        per_sample=lambda problems: problems,
        start_generate=lambda problems, step, round_, on_samples: started.append((step, problems)) or "pending",
    )


def _sample(i: int, version: int, later: int | None = None) -> RolloutSample:
    versions = None if later is None else torch.tensor([version, later])
    return RolloutSample(prompt_ids=[1, 2, i], output_ids=[3, i], output_logprobs=torch.tensor([-0.5, -0.25 * i]),
                         finish_reason="stop", weight_version=version, token_versions=versions,
                         routed_experts=torch.tensor([[[i, 1]]] * 4, dtype=torch.uint8))


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A checkpoint saved at step 2 by a max_staleness 2 run, with step 3's batch (positions 8..12,
    launched at version 1, a push to 2 landing in one response) and step 4's (12..16, launched at
    version 1 too: it trains at version 3, 2 versions old)."""
    monkeypatch.setattr(ahead_checkpoint, "rank_in", lambda group: 0)
    monkeypatch.setattr(ahead_checkpoint, "max_over", lambda tensor, group: tensor)
    monkeypatch.setattr(ahead_checkpoint, "all_reduce", lambda tensor, group: tensor)
    path = tmp_path / "step_000002"
    path.mkdir()
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"rollout": {"max_staleness": 2}}}))
    ahead = AsyncRollouts(_source(), 2, partial=True)
    ahead.ahead.append(NextBatch(3, 8, 12, [SimpleNamespace(sample_id=f"p{i}") for i in (8, 10)], None,
                                 [_sample(0, 1, later=2), *(_sample(i, 1) for i in range(1, 4))]))
    ahead.ahead.append(NextBatch(4, 12, 16, [SimpleNamespace(sample_id=f"p{i}") for i in (12, 14)], None,
                                 [_sample(i, 1) for i in range(4)]))
    save_batches(ahead, path, TrainerState(step=2, data_position=16, weight_version=2))
    return path


def test_the_batches_resume_whole_with_their_token_versions(checkpoint):
    state = TrainerState(step=2, data_position=16, weight_version=2)
    ahead = AsyncRollouts(_source(), 2, partial=True)
    resume_batches(ahead.source, checkpoint, state, ahead)
    assert state.data_position == 16 and [(b.step, b.start, b.end) for b in ahead.ahead] == [(3, 8, 12), (4, 12, 16)]
    assert [p.sample_id for p in ahead.ahead[0].problems] == ["p8", "p10"]
    got = ahead.ahead[0].samples
    assert got[0].versions().tolist() == [1, 2] and got[1].versions().tolist() == [1, 1]
    for got, want in zip(ahead.ahead[1].samples, [_sample(i, 1) for i in range(4)], strict=True):
        assert got.output_ids == want.output_ids and got.weight_version == 1
        assert torch.equal(got.output_logprobs, want.output_logprobs)
        assert torch.equal(got.routed_experts, want.routed_experts)


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_a_batch_too_old_for_a_shallower_pipeline_is_dropped_or_asked_again(checkpoint, policy):
    """Resumed with max_staleness 1, step 4's batch would train 2 versions old: it is dropped (its
    groups counted) or generated again under the current weights; step 3's (1 old) is kept."""
    state = TrainerState(step=2, data_position=16, weight_version=2)
    source = _source()
    ahead = AsyncRollouts(source, 1, partial=True)
    resume_batches(source, checkpoint, state, ahead, policy)
    assert ahead.ahead[0].step == 3 and ahead.ahead[0].samples is not None
    if policy == "drop":
        assert [b.step for b in ahead.ahead] == [3] and ahead.stale_dropped == 2 and not source.started
    else:
        assert [(b.step, b.pending) for b in ahead.ahead] == [(3, None), (4, "pending")]
        assert [(step, [p.sample_id for p in problems]) for step, problems in source.started] == [(4, ["p12", "p14"])]


@pytest.mark.parametrize("source, asynchronous", [(_source(), False), (_source(dp_size=4), True)],
                         ids=["synchronous", "other dp size"])
def test_batches_that_cannot_be_trained_give_their_prompts_back(checkpoint, source, asynchronous, capsys):
    state = TrainerState(step=2, data_position=16, weight_version=2)
    resume_batches(source, checkpoint, state, AsyncRollouts(source, 2, partial=True) if asynchronous else None)
    assert state.data_position == 8  # positions 8..15 are drawn again: none skipped, none twice
    assert "their prompts are drawn again" in capsys.readouterr().out


def test_prompts_drawn_between_the_batches_cannot_be_given_back(checkpoint):
    """Dynamic sampling drew step 2's extra round after step 3's batch: rewinding would train it twice."""
    state = TrainerState(step=2, data_position=20, weight_version=2)
    with pytest.raises(RuntimeError, match="between which other prompts were drawn"):
        resume_batches(_source(), checkpoint, state, None)


def test_files_of_a_synchronous_checkpoint_are_never_read(checkpoint):
    """A synchronous run that saved over the same step left the older rollouts/ behind."""
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"rollout": {}}}))
    state = TrainerState(step=2, data_position=16, weight_version=2)
    ahead = AsyncRollouts(_source(), 2, partial=True)
    resume_batches(ahead.source, checkpoint, state, ahead)
    assert not ahead.ahead and state.data_position == 16


def test_other_prompts_at_the_saved_positions_are_refused(checkpoint):
    source = _source(name="q")
    with pytest.raises(RuntimeError, match="answer other prompts than the training order gives at positions 8..12"):
        resume_batches(source, checkpoint, TrainerState(step=2, data_position=16, weight_version=2),
                       AsyncRollouts(source, 2, partial=True))


def test_a_checkpoint_of_the_one_batch_layout_reads_as_one_batch(tmp_path, monkeypatch):
    """Checkpoints written by max_staleness 1 runs before the buffer held k batches."""
    monkeypatch.setattr(ahead_checkpoint, "rank_in", lambda group: 0)
    monkeypatch.setattr(ahead_checkpoint, "max_over", lambda tensor, group: tensor)
    path = tmp_path / "step_000002"
    (path / "rollouts").mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 2, "config": {"rollout": {"max_staleness": 1}}}))
    (path / "rollouts" / "batch.json").write_text(json.dumps(
        {"saved_at_step": 2, "batch": {"step": 3, "start": 8, "end": 12, "dp_size": 2}}))
    torch.save({"samples": [_sample(i, 1) for i in range(4)], "sample_ids": ["p8", "p10"]},
               path / "rollouts" / "rank_00000.pt")
    ahead = AsyncRollouts(_source(), 1, partial=False)
    resume_batches(ahead.source, path, TrainerState(step=2, data_position=12, weight_version=2), ahead)
    assert [(b.step, len(b.samples)) for b in ahead.ahead] == [(3, 4)]
