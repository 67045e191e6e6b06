"""Recipe: tiny MAE (tests/launching.py `pretrain_recipe`) through ./launch.sh with 2 gloo processes, on the 8 train
shards with faults injected for real: a tar cut inside a sample, a `pipe:` shard whose command hangs, shards that
fail on every try. A shard that fails every try is skipped, named in the log and counted in `data/skipped_shards`
(cumulative across a resume); too many stop the run with one line (data/shard_read.py)."""

from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

import psutil
import pytest

from tests.launching import launch, losses, pretrain_recipe, read_metrics, write_recipe

pytestmark = [pytest.mark.dist, pytest.mark.faults]

HANG = "sleep 617"  # the hung shard's command: 10 minutes, and a process to look for afterwards
# Each read waits at most 8 s for a sample (a loaded test machine reads a local one well inside it), then one retry.
READS = {"read_timeout_s": 8.0, "read_retries": 1, "read_backoff_s": 0.1}


def _cut_copy(shards: Path, out: Path, numbers: set[int]) -> list[str]:
    """The train shards copied to `out`, those in `numbers` cut inside their first sample's image data (an error
    on the first read); returns the copies' paths in order."""
    out.mkdir()
    paths = []
    for number, shard in enumerate(sorted(shards.glob("*.tar"))):
        copy = out / shard.name
        if number in numbers:
            with tarfile.open(shard) as tar:
                image = next(m for m in tar.getmembers() if not m.name.endswith((".cls", ".json")))
            copy.write_bytes(shard.read_bytes()[: image.offset_data + image.size // 2])
        else:
            shutil.copy(shard, copy)
        paths.append(str(copy))
    return paths


def _hung_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if HANG in " ".join(process.info["cmdline"] or []) and process.status() != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _skipped(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["data/skipped_shards"] for m in read_metrics(run_dir) if "data/skipped_shards" in m}


def test_a_truncated_and_a_hung_shard_are_skipped_counted_and_the_run_resumes_with_the_count(shards, tmp_path):
    """Resampled streams (the default): each rank's stream opens every shard in its first pass, so each skips the
    cut shard and the hung one once (then they rest, data/shard_read.py `ShardCounts`): 4 over both ranks, summed by
    the loop's all-reduce. Resumed, the count goes on from the checkpoint's, without counting again the skips of the
    replayed range."""
    train = _cut_copy(shards["train"], tmp_path / "train", {3})
    hung = f"pipe:{HANG}; cat {train[5]}"
    train[5] = hung
    run_dir = tmp_path / "run"
    recipe = pretrain_recipe(
        shards, run_dir, data={"train": train, **READS, "max_skipped_shard_fraction": 0.4},
        schedule={"steps": 6, "warmup_steps": 2}, logging={"every_steps": 1, "image_every_steps": 0},
    )  # fmt: skip
    path = write_recipe(tmp_path / "tiny_mae_faulty_shards.yaml", recipe)
    proc = launch(path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(losses(run_dir)) == list(range(1, 7))
    skipped = _skipped(run_dir)
    assert skipped[6] == 4 and list(skipped.values()) == sorted(skipped.values()), skipped
    for url, why in ((train[3], "ReadError: unexpected end of data"), (hung, "no sample within 8 s")):
        lines = [line for line in proc.stdout.splitlines() if f"skipping the rest of shard {url} after 2 tries" in line]
        assert len(lines) == 2 and all(why in line for line in lines), proc.stdout[-4000:]  # one line per rank
    assert _hung_processes() == []

    proc = launch(path, "schedule.steps=8")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
    assert _skipped(run_dir)[8] == 4
    assert _hung_processes() == []


def test_too_many_failing_shards_stop_the_run_with_one_line(shards, tmp_path):
    """Epochs split over the ranks (not resampled): 2 of the 8 shards fail, more than 0.2 x 8 = 1.6. Whether one
    stream reads both (it stops at its second skip) or each rank one (the loop's sum over ranks stops rank 0 at the
    next logging step), one rank says why, in one line."""
    train = _cut_copy(shards["train"], tmp_path / "train", {2, 5})
    recipe = pretrain_recipe(
        shards, tmp_path / "run",
        data={"train": train, "resampled": False, **READS, "max_skipped_shard_fraction": 0.2},
        schedule={"steps": 400, "warmup_steps": 2}, logging={"every_steps": 1, "image_every_steps": 0},
        checkpoint={"every_steps": 1000},
    )  # fmt: skip
    proc = launch(write_recipe(tmp_path / "tiny_mae_failing_shards.yaml", recipe))
    output = proc.stdout
    assert proc.returncode == 1, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("[mimpipe] error:")]
    assert len(errors) == 1, output[-4000:]
    assert re.search(
        r"2 of \d+ shard reads failed and were skipped (over all ranks|by rank \d data worker 0), more than "
        r"data.max_skipped_shard_fraction=0.2 allows \(0.2 x max\(\d+ reads, 8 shards\) = 1.6\)",
        errors[0],
    ), errors[0]
    assert errors[0].rstrip(")").endswith(".log") and "raise data.max_skipped_shard_fraction" in errors[0]
    for url in (train[2], train[5]):
        assert f"skipping the rest of shard {url} after 2 tries (0 samples read): ReadError" in output
    assert max(losses(tmp_path / "run"), default=0) < 400
