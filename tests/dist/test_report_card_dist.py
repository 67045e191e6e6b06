"""`mimpipe evaluate` (finetune/report_card.py) under torchrun, 2 gloo processes: each rank embeds its own shards,
the features are gathered in the order of their sample keys, rank 0 measures and writes, and the row is the one a
single process gives; a pretraining run_dir without its export is read from its latest checkpoint (the reader
`pretrain export` uses) and gives its export's row."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from core.engine.distributed import DistInfo
from core.export.folder import export_model
from core.models.build import model_args
from finetune.report_card import Protocol, evaluate
from finetune.report_encoders import EncoderFlags
from tests.helpers.models import tiny_vit
from tests.launching import REPO, free_port, run_in_session

pytestmark = pytest.mark.dist

DIST = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
SUITE = ("knn", "linear", "fewshot", "rank")


def one_process(specs, shards) -> dict:
    protocol = Protocol(train=str(shards["train"]), val=str(shards["val"]), suite=SUITE, max_train=256, shots=(1, 5))
    return evaluate([str(s) for s in specs], protocol, EncoderFlags(), DIST, num_workers=0)


def test_two_ranks_give_the_row_of_one_process(shards, tmp_path):
    vit = tiny_vit(5)
    export = export_model(vit, tmp_path / "export", model_args=model_args(vit), manifest={"pooling_hint": "token"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "finetune", "evaluate", str(export), "--train", str(shards["train"]), "--val", str(shards["val"])]
    cmd += ["--out", str(tmp_path / "out"), "--max-train", "256", "--shots", "1,5", "--precision", "fp32"]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = run_in_session(cmd, cwd=REPO, env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]

    two = json.loads((tmp_path / "out" / "report.json").read_text())
    one = one_process([export], shards)
    assert (two["train_samples"], two["val_samples"]) == (256, 203)  # every image once, over both ranks
    assert two["rows"][0]["metrics"] == pytest.approx(one["rows"][0]["metrics"], rel=1e-5)
    assert proc.stdout.count("| checkpoint ") == 2  # rank 0 alone prints the table (and its settings)


def test_a_run_dir_without_its_export_is_read_from_its_latest_checkpoint(zero2_run, shards, tmp_path):
    run_dir, _ = zero2_run
    bare = tmp_path / "run"
    shutil.copytree(run_dir, bare, ignore=shutil.ignore_patterns("export"))
    report = one_process([run_dir, bare], shards)

    exported, from_checkpoint = report["rows"]
    assert exported["settings"]["path"] == str(run_dir / "export")
    assert from_checkpoint["settings"]["step"] == 6 and from_checkpoint["settings"]["pooling"] == "mean"
    assert from_checkpoint["metrics"] == pytest.approx(exported["metrics"], rel=1e-4)
