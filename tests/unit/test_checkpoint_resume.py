"""Finding the resume point: `latest`, per-rank state, and a world size that does not match."""

import json
from dataclasses import asdict

import pytest

from core.engine.checkpoint import find_resume
from core.engine.loop import TrainState


def _checkpoint(run_dir, world_size: int, step: int = 6):
    tag_dir = run_dir / "checkpoints" / f"step_{step:08d}"
    tag_dir.mkdir(parents=True)
    for rank in range(world_size):
        state = {"step": step, "world_size": world_size, "batches_consumed": 12}
        (tag_dir / f"rank_{rank:05d}.json").write_text(json.dumps(state))
    (run_dir / "checkpoints" / "latest").write_text(tag_dir.name)


def test_fresh_run_and_latest(tmp_path):
    assert find_resume(tmp_path, 0, 2) is None
    _checkpoint(tmp_path, world_size=2)
    resume = find_resume(tmp_path, 1, 2)
    assert resume["tag"] == "step_00000006" and resume["step"] == 6 and resume["batches_consumed"] == 12


def test_another_world_size_that_cannot_convert_is_refused_naming_both(tmp_path):
    _checkpoint(tmp_path, world_size=2)
    (tmp_path / "checkpoints" / "step_00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="written by 2 processes, this run has 1, and converting it to a universal"):
        find_resume(tmp_path, 0, 1)
    assert not (tmp_path / "checkpoints" / "step_00000006" / "universal").exists()


def test_a_missing_rank_state_is_named(tmp_path):
    _checkpoint(tmp_path, world_size=4)
    (tmp_path / "checkpoints" / "step_00000006" / "rank_00003.json").unlink()
    with pytest.raises(ValueError, match="no state for rank 3"):
        find_resume(tmp_path, 3, 4)


def test_another_world_size_without_zero_partitions_loads_the_checkpoint_as_it_is(tmp_path):
    _checkpoint(tmp_path, world_size=2)  # ZeRO-0 writes no zero_pp_rank_* files
    resume = find_resume(tmp_path, 0, 1)
    assert resume["load_tag"] == resume["tag"] == "step_00000006" and not resume["universal"]
    assert resume["step"] == 6 and resume["batches_consumed"] == 12 and resume["from_world_size"] == 2
    assert resume["rng"] is None  # the old ranks' RNG states do not fit the new ranks


def test_train_state_comes_back_whole_including_the_best_evaluation(tmp_path):
    """Fine-tuning keeps its best val/top1 in the TrainState the loop checkpoints: a resumed run exports only what
    beats the best of the run before it."""
    state = TrainState(step=6, batches_consumed=12, nonfinite_skipped=1, corrupt_samples=2, best_top1=0.75, best_step=4)
    _checkpoint(tmp_path, world_size=1)
    rank_file = tmp_path / "checkpoints" / "step_00000006" / "rank_00000.json"
    rank_file.write_text(json.dumps({"world_size": 1, "rng": None, **asdict(state)}))  # as save_checkpoint writes it
    assert TrainState.from_resume(find_resume(tmp_path, 0, 1)) == state
    assert TrainState.from_resume(None) == TrainState(best_top1=-1.0, best_step=0)
