"""Which checkpoints are complete or damaged, which one a run resumes from when `latest` cannot be loaded, what pruning
removes, and the loss-spike judgement of core/engine/rollback.py."""

import json
import math
from collections import deque

import pytest
import torch

from core.engine.rollback import is_spike
from core.launch.ckpt_files import (
    COMPLETE,
    LATEST,
    checkpoint_bytes,
    choose_resume,
    prune,
    read_latest,
    step_of,
    tag_folders,
    why_damaged,
    why_incomplete,
    write_marker,
)
from tests.helpers.files import rot_a_tensor


def _tag(ckpt_dir, step: int, *, complete: bool = True):
    tag_dir = ckpt_dir / f"step_{step:08d}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    (tag_dir / "rank_00000.json").write_text(json.dumps({"train": {"step": step}}))
    if complete:
        write_marker(tag_dir, {p.name: p.stat().st_size for p in tag_dir.iterdir()})
    return tag_dir


def test_tags_are_ordered_by_step_number_not_by_name(tmp_path):
    for name in ("step_9", "step_00000010", "step_100", "step_x", "step_1.old"):
        (tmp_path / name).mkdir()
    assert [step for step, _ in tag_folders(tmp_path)] == [9, 10, 100]
    assert step_of("step_1.old") is None and step_of("step_00000042") == 42


def test_a_torn_or_truncated_file_makes_a_checkpoint_incomplete(tmp_path):
    tag_dir = _tag(tmp_path, 4)
    assert why_incomplete(tag_dir) is None
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 60)
    assert why_incomplete(tag_dir) == "mp_rank_00_model_states.pt has 60 bytes, 100 were written"
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    assert why_incomplete(tag_dir) == "mp_rank_00_model_states.pt is missing"
    (tag_dir / COMPLETE).write_text("{tor")
    assert "no completeness marker" in why_incomplete(tag_dir)


@pytest.mark.parametrize("latest", [None, "", "step_000", "garbage\x00", "step_00000008"])
def test_resume_falls_back_to_the_newest_complete_checkpoint_and_says_so(tmp_path, latest):
    """`latest` missing, torn, naming nothing, or naming an incomplete folder (a save killed before its marker)."""
    _tag(tmp_path, 4)
    _tag(tmp_path, 6)
    _tag(tmp_path, 8, complete=False)
    if latest is not None:
        (tmp_path / LATEST).write_text(latest)
    tag, note = choose_resume(tmp_path)
    assert tag == "step_00000006"
    assert note.startswith("[mimpipe] warning: ") and note.endswith("step_00000006, the newest complete one")
    if latest == "step_00000008":
        assert "names step_00000008, which cannot be loaded: no completeness marker" in note


@pytest.mark.parametrize("held", ["step_000", "step_0000000", "step_000000006", "step_00000006.tmp", "step_"])
def test_latest_cut_short_is_no_tag_and_the_resume_falls_back_to_the_newest_complete_one(tmp_path, held):
    """A `latest` holding less (or more) than a whole `step_NNNNNNNN` name, as `tag_of` writes it, names no
    checkpoint: `step_000` is a truncated `step_00000006`, not step 0. The resume falls back as for a torn one,
    with one line saying so."""
    _tag(tmp_path, 4)
    _tag(tmp_path, 6)
    (tmp_path / LATEST).write_text(held)
    assert read_latest(tmp_path) is None
    assert choose_resume(tmp_path) == (
        "step_00000006",
        f"[mimpipe] warning: {tmp_path / LATEST} is unreadable or names no checkpoint; resuming from "
        f"{tmp_path / 'step_00000006'}, the newest complete one",
    )
    for whole in ("step_00000006\n", "step_123456789"):  # an editor's newline is stripped; past 10^8 steps, 9 digits
        (tmp_path / LATEST).write_text(whole)
        assert read_latest(tmp_path) == whole.strip()


def test_a_latest_naming_an_incomplete_checkpoint_falls_back_to_its_complete_predecessor(tmp_path):
    _tag(tmp_path, 6)
    _tag(tmp_path, 8, complete=False)
    (tmp_path / LATEST).write_text("step_00000008")
    assert read_latest(tmp_path) == "step_00000008"  # a whole tag: the resume finds it incomplete
    assert choose_resume(tmp_path) == (
        "step_00000006",
        f"[mimpipe] warning: {tmp_path / LATEST} names step_00000008, which cannot be loaded: no completeness marker "
        f"(a save that did not finish); resuming from {tmp_path / 'step_00000006'}, the newest complete one",
    )


def test_a_flipped_bit_that_torch_load_would_not_notice_makes_a_checkpoint_damaged(tmp_path):
    shard = tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"exp_avg": torch.arange(4096.0)}, shard)
    (tmp_path / "rank_00001.json").write_text(json.dumps({"train": {"step": 4}}))
    names = ["rank_00001.json", shard.name]
    assert why_damaged(tmp_path, names) is None
    rot_a_tensor(shard)
    assert not torch.equal(torch.load(shard)["exp_avg"], torch.arange(4096.0))  # torch loads it, wrong, silently
    problem = why_damaged(tmp_path, names)
    assert problem.startswith(f"{shard.name} is damaged: its record ") and problem.endswith(" fails its CRC-32 check")
    (tmp_path / "rank_00001.json").write_text('{"train": {"step"')
    assert why_damaged(tmp_path, names).startswith("rank_00001.json is damaged: ")


def test_a_damaged_checkpoint_is_never_chosen(tmp_path):
    _tag(tmp_path, 4)
    _tag(tmp_path, 6)
    (tmp_path / LATEST).write_text("step_00000006")
    tag, note = choose_resume(tmp_path, {"step_00000006": "x.pt is damaged"})
    assert tag == "step_00000004" and "names step_00000006, which cannot be loaded: x.pt is damaged; " in note
    assert choose_resume(tmp_path, {"step_00000004": "x.pt is damaged"}) == ("step_00000006", None)


def test_latest_is_resumed_when_complete_even_with_newer_folders(tmp_path):
    _tag(tmp_path, 4)
    _tag(tmp_path, 6)
    (tmp_path / LATEST).write_text("step_00000004")  # a run rolled back to step 4 and not saved since
    assert choose_resume(tmp_path) == ("step_00000004", None)


def test_a_run_dir_from_before_the_markers_resumes_from_latest(tmp_path):
    _tag(tmp_path, 4, complete=False)
    _tag(tmp_path, 8, complete=False)
    (tmp_path / LATEST).write_text("step_00000004")
    assert choose_resume(tmp_path) == ("step_00000004", None)


def test_nothing_complete_starts_from_scratch_with_a_line_but_a_fresh_run_says_nothing(tmp_path):
    assert choose_resume(tmp_path) == (None, None)
    (tmp_path / LATEST).write_text("step_00000004")  # names a folder that is gone
    tag, note = choose_resume(tmp_path)
    assert tag is None and "no other checkpoint is complete; starting from scratch" in note


def test_pruning_keeps_the_new_checkpoint_despite_a_stale_partial_folder_of_a_higher_step(tmp_path):
    """The bug this guards: pruning kept the `keep_last` highest step folders, so a partial step_00000900 (a save
    killed past the grace period) made it delete the checkpoint just written."""
    for step in (100, 200, 300):
        _tag(tmp_path, step)
    _tag(tmp_path, 900, complete=False)
    _tag(tmp_path, 150, complete=False)
    removed = prune(tmp_path, keep_last=2, keep={"step_00000300"})
    assert removed == ["step_00000100", "step_00000150", "step_00000900"]
    assert [p.name for _, p in tag_folders(tmp_path)] == ["step_00000200", "step_00000300"]


def test_pruning_never_removes_the_tags_it_is_told_to_keep(tmp_path):
    _tag(tmp_path, 100)
    _tag(tmp_path, 200)
    _tag(tmp_path, 300)
    prune(tmp_path, keep_last=1, keep={"step_00000100"})  # e.g. the one `latest` names
    assert [p.name for _, p in tag_folders(tmp_path)] == ["step_00000100", "step_00000300"]


def test_a_spike_is_judged_against_a_full_window_only():
    history = deque([1.0, 2.0, 1.5], maxlen=4)
    assert not is_spike(history, 100.0, factor=5)  # the window is still filling up
    history.append(1.2)
    assert not is_spike(history, 6.7, factor=5)  # median 1.35: 6.75 is the threshold
    assert is_spike(history, 6.8, factor=5)


def test_a_save_is_skipped_when_the_disk_cannot_take_the_previous_checkpoints_size(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from core.engine import checkpoint

    need = checkpoint_bytes(_tag(tmp_path / "checkpoints", 4))  # from its marker
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, math.ceil(need * 1.1)))
    assert checkpoint._space_short(None, tmp_path / "checkpoints", "step_00000004") is None
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, need))
    short = checkpoint._space_short(None, tmp_path / "checkpoints", "step_00000004")
    assert short.startswith("0.00 GiB free in ") and short.endswith("checkpoints, a checkpoint takes about 0.00 GiB")
