"""Finding the resume point (`latest`, per-rank states, another world size) and the states that come back."""

import base64
import json
import random
import threading
import time

import numpy as np
import pytest
import torch

from core.engine.checkpoint import ConversionFiles, RNGState, find_resume, load_states
from core.engine.failure import PeerLostError
from core.engine.train_state import TrainState
from core.launch.ckpt_files import write_marker
from tests.helpers.files import flip_a_bit, rot_a_tensor

TRAIN = TrainState(
    step=6, batches_consumed=12, nonfinite_skipped=1, consecutive_nonfinite=1, corrupt_samples=2, best_top1=0.75,
    best_step=4,
)  # fmt: skip


def _checkpoint(run_dir, world_size: int, step: int = 6, train: TrainState = TRAIN):
    """Rank files as `save_checkpoint` writes them, marked complete."""
    tag_dir = run_dir / "checkpoints" / f"step_{step:08d}"
    tag_dir.mkdir(parents=True)
    for rank in range(world_size):
        saved = {"world_size": world_size, "train": train.state_dict(), "rng": {"rank": rank}}
        (tag_dir / f"rank_{rank:05d}.json").write_text(json.dumps(saved))
    write_marker(tag_dir, {p.name: p.stat().st_size for p in tag_dir.iterdir()})
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


def test_a_damaged_checkpoint_is_passed_over_for_the_newest_that_reads_back_whole(tmp_path, capsys):
    """Bit rot in `latest` and the one before: every file of a candidate is read back before anything loads it."""
    ckpt_dir = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        tag_dir = ckpt_dir / f"step_{step:08d}"
        tag_dir.mkdir(parents=True)
        torch.save({"module": torch.full((1024,), float(step))}, tag_dir / "mp_rank_00_model_states.pt")
        (tag_dir / "rank_00000.json").write_text(json.dumps({"world_size": 1, "train": {"step": step}}))
        write_marker(tag_dir, {p.name: p.stat().st_size for p in tag_dir.iterdir()})
    (ckpt_dir / "latest").write_text("step_00000006")
    rot_a_tensor(ckpt_dir / "step_00000006" / "mp_rank_00_model_states.pt")
    (ckpt_dir / "step_00000004" / "rank_00000.json").write_text('{"world_size": 1, "train": {"step": 5}}')  # same size
    flip_a_bit(ckpt_dir / "step_00000004" / "rank_00000.json", at=0)  # `{` no more
    assert find_resume(tmp_path, 0, 1)["tag"] == "step_00000002"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"[mimpipe] warning: passed over damaged {ckpt_dir / 'step_00000004'} (rank_00000.json")
    assert lines[1].startswith(
        f"[mimpipe] warning: {ckpt_dir / 'latest'} names step_00000006, which cannot be loaded: "
        "mp_rank_00_model_states.pt is damaged: its record "
    )
    assert lines[1].endswith(f"resuming from {ckpt_dir / 'step_00000002'}, the newest complete one")


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
        find_resume(tmp_path, 3, 4, step=6)
    assert find_resume(tmp_path, 3, 4) is None  # incomplete now: not resumed


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
    write_marker(tag_dir, {"rank_00000.json": (tag_dir / "rank_00000.json").stat().st_size})
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


class _FakeCuda:
    """torch.cuda's RNG functions for `num_devices` GPUs with `current` as this process's device: every generator's
    state is a distinct 16-byte tensor. `get_rng_state_all` / `set_rng_state_all` behave as torch's do (one state per
    visible GPU; a state for a GPU that is not there fails), so code that used them fails these tests."""

    def __init__(self, monkeypatch, num_devices: int, current: int):
        self.num_devices, self.current = num_devices, current
        self.states = [torch.full((16,), 10 * current + i, dtype=torch.uint8) for i in range(num_devices)]
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "current_device"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: num_devices)

    def _index(self, device) -> int:
        return self.current if device in ("cuda", None) else torch.device(device).index

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self._index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [state.clone() for state in self.states]

    def set_rng_state_all(self, states) -> None:
        for index, state in enumerate(states):
            if index >= self.num_devices:
                raise RuntimeError(f"Invalid device index {index}: {self.num_devices} devices")
            self.states[index] = state.clone()


def test_rng_state_holds_this_ranks_gpu_and_resumes_where_each_process_sees_fewer_gpus(monkeypatch):
    """Saved by the rank on GPU 5 of a node with 8 visible GPUs; resumed (same world size) by a rank on GPU 1 of a
    node with 4: its own generator gets the saved GPU 5 state, the other GPUs' stay as they were."""
    saving = _FakeCuda(monkeypatch, num_devices=8, current=5)
    saved = json.loads(json.dumps(RNGState().state_dict()))
    assert isinstance(saved["cuda"], str)  # one generator, not a list of every visible GPU's
    loading = _FakeCuda(monkeypatch, num_devices=4, current=1)
    untouched = [loading.states[i].clone() for i in (0, 2, 3)]
    RNGState().load_state_dict(saved)
    assert torch.equal(loading.states[1], saving.states[5])
    assert all(torch.equal(loading.states[i], state) for i, state in zip((0, 2, 3), untouched, strict=True))


def test_rng_state_of_every_visible_gpu_from_older_checkpoints_gives_this_ranks_own(monkeypatch):
    old = _FakeCuda(monkeypatch, num_devices=8, current=0)
    saved = json.loads(json.dumps(RNGState().state_dict()))
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    saved["cuda"] = [b64(state) for state in old.states]  # the format checkpoints had before
    loading = _FakeCuda(monkeypatch, num_devices=4, current=3)
    RNGState().load_state_dict(saved)
    assert torch.equal(loading.states[3], old.states[3])
    loading = _FakeCuda(monkeypatch, num_devices=16, current=12)  # beyond the saved list: left as it is
    before = loading.states[12].clone()
    RNGState().load_state_dict(saved)
    assert torch.equal(loading.states[12], before)


def test_ranks_wait_for_rank_0s_conversion_while_its_heartbeat_moves(tmp_path):
    """A conversion that outlasts the staleness limit is waited for as long as the heartbeat moves. The limit is 30
    beats long: a loaded machine that leaves the beating thread unscheduled for a few beats does not fail it (at 0.5 s
    for 5 beats of 0.1 s, a fresh clone's `make test` once did)."""
    files = ConversionFiles(tmp_path)

    def convert():
        for beat in range(50):
            files.heartbeat.write_text(str(beat))
            time.sleep(0.05)
        files.universal.mkdir()

    rank_0 = threading.Thread(target=convert)
    rank_0.start()
    start = time.monotonic()
    files.wait(stale_s=1.5, poll_s=0.02)
    assert files.universal.is_dir() and time.monotonic() - start > 1.5
    rank_0.join()


def test_a_failed_or_silent_conversion_stops_the_waiting_ranks(tmp_path):
    files = ConversionFiles(tmp_path)
    files.heartbeat.write_text("3")
    start = time.monotonic()
    with pytest.raises(PeerLostError, match=f"rank 0 showed no sign of converting {tmp_path} for 0 s"):
        files.wait(stale_s=0.3, poll_s=0.02)
    assert 0.3 < time.monotonic() - start < 5
    files.failed.write_text("checkpoint ... converting it to a universal checkpoint failed")
    with pytest.raises(PeerLostError, match=f"rank 0 could not convert {tmp_path} to a universal checkpoint"):
        files.wait(stale_s=60, poll_s=0.02)
