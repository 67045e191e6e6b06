"""Finding the resume point (`latest`, per-rank states, another world size) and the states that come back."""

import json
import random

import numpy as np
import pytest
import torch

from core.engine.checkpoint import RNGState, find_resume, load_states
from core.engine.loop import TrainState

TRAIN = TrainState(
    step=6, batches_consumed=12, nonfinite_skipped=1, consecutive_nonfinite=1, corrupt_samples=2, best_top1=0.75,
    best_step=4,
)  # fmt: skip


def _checkpoint(run_dir, world_size: int, step: int = 6, train: TrainState = TRAIN):
    """Rank files as `save_checkpoint` writes them."""
    tag_dir = run_dir / "checkpoints" / f"step_{step:08d}"
    tag_dir.mkdir(parents=True)
    for rank in range(world_size):
        saved = {"world_size": world_size, "train": train.state_dict(), "rng": {"rank": rank}}
        (tag_dir / f"rank_{rank:05d}.json").write_text(json.dumps(saved))
    (run_dir / "checkpoints" / "latest").write_text(tag_dir.name)
    return tag_dir


def _resumed_train_state(resume) -> TrainState:
    state = TrainState()
    load_states(resume, {"train": state})
    return state


def test_fresh_run_and_latest(tmp_path):
    assert find_resume(tmp_path, 0, 2) is None
    assert _resumed_train_state(None) == TrainState(best_top1=-1.0, best_step=0)
    _checkpoint(tmp_path, world_size=2)
    resume = find_resume(tmp_path, 1, 2)
    assert resume["tag"] == resume["load_tag"] == "step_00000006" and not resume["universal"]
    assert resume["states"]["rng"] == {"rank": 1}  # this rank's own
    assert _resumed_train_state(resume) == TRAIN


def test_another_world_size_that_cannot_convert_is_refused_naming_both(tmp_path):
    tag_dir = _checkpoint(tmp_path, world_size=2)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="written by 2 processes, this run has 1, and converting it to a universal"):
        find_resume(tmp_path, 0, 1)
    assert not (tag_dir / "universal").exists()


def test_a_missing_rank_state_is_named(tmp_path):
    tag_dir = _checkpoint(tmp_path, world_size=4)
    (tag_dir / "rank_00003.json").unlink()
    with pytest.raises(ValueError, match="no state for rank 3"):
        find_resume(tmp_path, 3, 4)


def test_another_world_size_carries_the_whole_train_state_but_not_the_rngs(tmp_path):
    """The bug this guards: elastic resume kept a hand-written list of fields and dropped best_top1 / best_step, so a
    fine-tuning run resumed on another number of processes overwrote its better export at the first evaluation."""
    _checkpoint(tmp_path, world_size=2)  # ZeRO-0 writes no zero_pp_rank_* files: loaded as it is
    resume = find_resume(tmp_path, 0, 1)
    assert resume["load_tag"] == resume["tag"] == "step_00000006" and not resume["universal"]
    assert resume["from_world_size"] == 2
    assert "rng" not in resume["states"]  # the old ranks' RNG states do not fit the new ranks
    assert _resumed_train_state(resume) == TRAIN  # every field, from the dataclass itself


def test_checkpoints_from_before_named_states_still_resume(tmp_path):
    tag_dir = _checkpoint(tmp_path, world_size=1)
    flat = {"step": 6, "world_size": 1, "rng": {"rank": 0}, "batches_consumed": 12, "best_top1": 0.5}
    (tag_dir / "rank_00000.json").write_text(json.dumps(flat))
    resume = find_resume(tmp_path, 0, 1)
    assert resume["states"]["rng"] == {"rank": 0}
    assert _resumed_train_state(resume) == TrainState(step=6, batches_consumed=12, best_top1=0.5)


def test_train_state_refuses_fields_it_does_not_know():
    with pytest.raises(ValueError, match=r"\['best_top5'\]"):
        TrainState().load_state_dict({"step": 3, "best_top5": 0.9})


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = json.loads(json.dumps(RNGState().state_dict()))
    expected = random.random(), np.random.rand(), torch.rand(())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RNGState().load_state_dict(saved)
    assert (random.random(), np.random.rand(), torch.rand(())) == expected
