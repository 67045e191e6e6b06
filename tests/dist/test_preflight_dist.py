"""Recipe: tiny fine-tune from scratch (below), through ./launch.sh with 2 gloo processes. Bad input found before
launch stops launch.sh with exit code 2 and one line per problem; bad input found mid-stream (a shard whose samples
have no label) ends the run with one `[mimpipe] error:` line on the console and the traceback in run_dir/logs."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from tests.launching import TINY_MODEL, copy_shards, launch, write_recipe

pytestmark = pytest.mark.dist


def finetune_recipe(train, run_dir) -> dict:
    return {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": dict(TINY_MODEL),
        # Each epoch splits the shard permutation over the 2 ranks: one rank reads a given shard, in order.
        "data": {
            "train": str(train),
            "global_batch_size": 32,
            "num_workers": 1,
            "resampled": False,
            "shuffle_buffer": 0,
        },
        "objective": {"kind": "classification"},
        "schedule": {"steps": 200, "warmup_steps": 1},
        "engine": {"device": "cpu", "zero_stage": 1},
        "checkpoint": {"every_steps": 1000},
        "logging": {"every_steps": 10},
    }


def test_bad_input_stops_launch_sh_before_any_process_starts(shards, tmp_path):
    (tmp_path / "file").write_text("")
    recipe = write_recipe(tmp_path / "bad.yaml", finetune_recipe(shards["train"], tmp_path / "file" / "run"))
    no_labels = copy_shards(shards["train"], tmp_path / "nocls", drop="cls")
    proc = launch(recipe, f"data.val={no_labels}", f"model.init={tmp_path}/gone.pth", timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("launch.sh:")]
    assert [line.split(":")[1].strip() for line in lines] == ["run_dir", "data.val", "model.init"], proc.stdout
    assert f"{tmp_path}/file/run" in lines[0] and f"{no_labels}/train-000000.tar" in lines[1]
    assert f"{tmp_path}/gone.pth" in lines[2]
    assert "Traceback" not in proc.stdout and "[mimpipe] stage" not in proc.stdout


def test_no_room_for_the_checkpoints_stops_every_rank_before_the_engine(shards, tmp_path):
    """Rank 0 finds the filesystem too small for checkpoint.keep_last + 1 checkpoints (10^12 of them here) and tells
    rank 1: both stop with exit code 2 before any engine is built (torchrun ends the second once the first has), with
    one line naming run_dir, and launch.sh exits 2 as well (torchrun's agent exits as its refused ranks)."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "finetune.yaml", finetune_recipe(shards["train"], run_dir))
    proc = launch(recipe, f"checkpoint.keep_last={10**12}", timeout=180)
    assert proc.returncode == 2 and "[mimpipe] torchrun:" not in proc.stdout, proc.stdout[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("[mimpipe] refused: run_dir:")]
    assert len(refused) == 1 and f"{run_dir}: " in refused[0], proc.stdout[-3000:]
    assert "checkpoint.keep_last 1000000000000 + 1 while saving" in refused[0]
    assert "[mimpipe] stage finetune" not in proc.stdout and not (run_dir / "checkpoints" / "latest").exists()


def test_label_missing_mid_stream_is_one_error_line_and_a_logged_traceback(shards, tmp_path):
    train = copy_shards(shards["train"], tmp_path / "train", drop="cls", in_shards={2})  # 8 shards of 64
    run_dir = tmp_path / "run"
    proc = launch(write_recipe(tmp_path / "finetune.yaml", finetune_recipe(train, run_dir)), timeout=300)
    output = proc.stdout
    assert proc.returncode != 0, output[-4000:]
    assert "[mimpipe] pre-flight:" in output and "[mimpipe] stage finetune" in output  # the first shard has labels

    errors = [line for line in output.splitlines() if line.startswith("[mimpipe] error:")]
    assert len(errors) == 1, output[-4000:]
    # The sample, the shard and the missing field, whichever pipeline message names them.
    named = re.search(r"sample (\S+) in shard (\S+) ", errors[0])
    assert named and named[2] == f"{train}/train-000002.tar" and ".cls" in errors[0], errors[0]
    with tarfile.open(named[2]) as tar:  # shards are read several at a time: any sample of that shard may come first
        assert named[1] in {name.split(".")[0] for name in tar.getnames()}
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]
    assert "[mimpipe] torchrun: finetune failed: rank" in output

    log = re.search(r"traceback in (\S+rank\d\.log)\)$", errors[0])
    assert log and log.group(1).startswith(str(run_dir / "logs")), errors[0]
    text = Path(log.group(1)).read_text()
    assert "Traceback (most recent call last)" in text and "train-000002.tar" in text
