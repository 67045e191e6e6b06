"""Segmentation fine-tuning with real processes: from an MAE export at 2 ranks through ./launch.sh, and the
evaluation's mIoU at 1 and 2 ranks (torchrun, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import timm
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from core.report.metrics import confusion_counts, segmentation_scores
from data.__main__ import main as data_main
from data.index import shard_samples
from data.segmentation import IGNORE_INDEX, SEG_FIELD, decode_mask
from tests.helpers.datasets import needs_fashion_mnist
from tests.launching import REPO, TINY_MODEL, assert_resume_repeats, launch, read_metrics, torchrun, write_recipe

pytestmark = [pytest.mark.dist, needs_fashion_mnist]


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenes")
    for split, num, size in (("train", 48, 12), ("val", 16, 4)):
        data_main(["write", "--source", "fashion-mnist-scenes", "--split", split, "--num-samples", str(num),
                   "--out", str(root / split), "--shard-size", str(size)])  # fmt: skip
    return root


def seg_recipe(scenes, run_dir, init, **objective) -> dict:
    return {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": {**TINY_MODEL, "img_size": 32, "init": str(init)},
        "data": {
            "train": str(scenes / "train"),
            "val": str(scenes / "val"),
            "global_batch_size": 8,
            "num_workers": 1,
            "mean": [0.2, 0.2, 0.2],
            "std": [0.3, 0.3, 0.3],
        },  # fmt: skip
        "objective": {"kind": "segmentation", "channels": 16, **objective},
        "optim": {"base_lr": 1e-3, "layer_decay": 0.75},
        "schedule": {"steps": 4, "warmup_steps": 1},
        "engine": {"device": "cpu", "zero_stage": 2},
        "checkpoint": {"every_steps": 4},
        "logging": {"every_steps": 2},
        "eval": {"every_steps": 2},
    }


def test_upernet_finetunes_from_an_mae_export_and_exports_encoder_and_head(zero2_run, scenes, tmp_path):
    """16 px MAE export -> 32 px UperNet (pos-embed 4x4 -> 8x8), 2 ranks, evaluated at steps 2 and 4."""
    run_dir, _ = zero2_run
    recipe = write_recipe(tmp_path / "seg.yaml", seg_recipe(scenes, tmp_path / "run", run_dir / "export"))
    proc = launch(recipe)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "pos_embed" in proc.stdout and "per-class IoU at step 4" in proc.stdout
    evals = [m for m in read_metrics(tmp_path / "run") if "val/miou" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["val/images"] == 16 for m in evals)
    assert all(0.0 <= m["val/miou"] <= 1.0 and 0.0 < m["val/pixel_acc"] <= 1.0 for m in evals)
    train = [m for m in read_metrics(tmp_path / "run") if "train/pixel_acc" in m]
    assert train and all(torch.isfinite(torch.tensor(m["train/loss"])) for m in train)
    events = [EventFileLoader(str(f)).Load() for f in (tmp_path / "run" / "tb").glob("events.out.tfevents.*")]
    tags = [value.tag for loaded in events for event in loaded for value in event.summary.value]
    assert tags.count("inspect/attention_distance") == 2 and "val/segmentation" in tags  # steps 1 and 4 (the last)

    export = tmp_path / "run" / "export"
    manifest = json.loads((export / "mimpipe.json").read_text())
    best = max(evals, key=lambda m: (m["val/miou"], -m["step"]))
    assert manifest["method"] == "segmentation" and manifest["step"] == best["step"]
    assert manifest["segmentation"]["head"] == "upernet" and manifest["classes"][0] == "background"
    encoder = timm.create_model(f"local-dir:{export}", pretrained=True)  # strict: the encoder alone
    assert encoder.pos_embed.shape == (1, 1 + 64, 32)
    head = safetensors.torch.load_file(str(export / "seg_head.safetensors"))
    assert head["head.classifier.weight"].shape == (11, 16, 1, 1) and "aux_head.classifier.weight" in head
    assert not any(k.startswith("encoder.") for k in head)

    # predict: the export's masks of the validation images score what the run's evaluation scored (it ran in bf16)
    cmd = [sys.executable, "-m", "finetune", "predict", str(export), "--images", str(scenes / "val"), "--out",
           str(tmp_path / "masks")]  # fmt: skip
    assert subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).returncode == 0
    confusion = torch.zeros(11, 11, dtype=torch.int64)
    for shard in sorted((scenes / "val").glob("*.tar")):
        for sample in shard_samples(str(shard), frozenset({SEG_FIELD})):
            with Image.open(tmp_path / "masks" / f"{sample['__key__']}.png") as mask:
                assert mask.mode == "P"  # class ids, shown in colour
                predicted = torch.from_numpy(np.array(mask))
            truth = torch.from_numpy(decode_mask(sample[SEG_FIELD]))
            confusion += confusion_counts(predicted, truth, 11, IGNORE_INDEX)
    assert segmentation_scores(confusion)["miou"] == pytest.approx(best["val/miou"], abs=0.02)
    assert json.loads((tmp_path / "masks" / "classes.json").read_text())[0]["name"] == "background"


def test_miou_is_the_same_on_one_and_two_ranks(scenes):
    """The confusion matrices are summed over ranks: every pixel of every image once, at any world size, whole and
    sliding-window alike (one launch per world size evaluates both)."""
    outputs = [torchrun("seg_eval_worker.py", scenes / "val", "whole", "slide", nproc=n).stdout for n in (1, 2)]
    lines = [[line for line in out.splitlines() if line.startswith(("metrics", "confusion"))] for out in outputs]
    assert lines[0] == lines[1] and len(lines[0]) == 4, outputs
    for mode, (metrics, confusion) in zip(("whole", "slide"), (lines[0][:2], lines[0][2:]), strict=True):
        assert metrics.split()[1] == confusion.split()[1] == mode
        assert metrics.split()[-1] == "16.0"  # every validation image
        cells = torch.tensor([int(v) for v in confusion.split()[2:]])
        assert cells.sum() > 16 * 64 * 64  # every scored pixel, at the masks' own sizes (64-96 px a side)


def test_a_classification_set_is_refused_before_any_process_starts(shards, scenes, tmp_path):
    recipe = seg_recipe(scenes, tmp_path / "run", tmp_path / "no_export")
    recipe["data"] |= {"train": str(shards["train"]), "val": str(shards["val"])}
    proc = launch(write_recipe(tmp_path / "seg.yaml", recipe), nproc=1)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stdout[-3000:]
    assert f"no segmentation entry in {shards['train'] / 'index.json'}" in proc.stdout


def test_a_zero3_run_resumes_where_it_stopped_and_exports_whole_weights(zero2_run, scenes, tmp_path):
    """ZeRO-3 partitions the encoder, neck and heads over 2 ranks; a resume from step 2 repeats steps 3-4 (losses and
    the evaluation at step 4), and the export gathers every tensor whole."""
    run_dir, _ = zero2_run
    recipe = seg_recipe(scenes, tmp_path / "run", run_dir / "export")
    recipe |= {"engine": {"device": "cpu", "zero_stage": 3}, "checkpoint": {"every_steps": 2}}
    recipe["logging"] = {"every_steps": 1}
    proc = launch(write_recipe(tmp_path / "seg.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_resume_repeats(tmp_path / "run", tmp_path / "resumed", from_step=2, last_step=4)
    miou = [
        {m["step"]: m["val/miou"] for m in read_metrics(tmp_path / d) if "val/miou" in m} for d in ("run", "resumed")
    ]
    assert miou[1] == {4: miou[0][4]}

    export = tmp_path / "run" / "export"
    encoder = timm.create_model(f"local-dir:{export}", pretrained=True)  # strict: every tensor whole
    assert encoder.pos_embed.shape == (1, 1 + 64, 32)
    head = safetensors.torch.load_file(str(export / "seg_head.safetensors"))
    assert head["head.classifier.weight"].shape == (11, 16, 1, 1)
    assert head["head.fuse.1.running_var"].shape == (16,)


def test_vt_fpn_trains_on_a_resnet_from_a_timm_state_dict_and_predicts_from_its_export(scenes, tmp_path):
    """A ResNet-18 classifier's weights -> VT-FPN at 64 px, 2 ranks (the backbone's BatchNorm synchronised), export,
    then `predict` from the export scores what the run's best evaluation scored."""
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet18", num_classes=7).state_dict(), tmp_path / "r18.pth")
    recipe = seg_recipe(scenes, tmp_path / "run", tmp_path / "r18.pth", head="vt_fpn", channels=32)
    recipe["model"] = {"arch": "resnet", "resnet_variant": 18, "img_size": 64, "init": str(tmp_path / "r18.pth")}
    proc = launch(write_recipe(tmp_path / "seg.yaml", recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "dropped" in proc.stdout and "fc.weight" in proc.stdout  # the classifier is not the encoder's
    evals = [m for m in read_metrics(tmp_path / "run") if "val/miou" in m]
    assert [m["step"] for m in evals] == [2, 4]

    export = tmp_path / "run" / "export"
    encoder = timm.create_model(f"local-dir:{export}", pretrained=True)  # strict: timm's resnet18
    assert type(encoder).__name__ == "ResNet" and encoder.layer4[1].conv2.weight.shape == (512, 512, 3, 3)
    manifest = json.loads((export / "mimpipe.json").read_text())
    assert manifest["segmentation"]["head"] == "vt_fpn" and manifest["segmentation"]["channels"] == 32
    head = safetensors.torch.load_file(str(export / "seg_head.safetensors"))
    assert head["head.tokens.tokenizers.0.filters.weight"].shape == (8, 32)  # 8 visual tokens per level
    cmd = [sys.executable, "-m", "finetune", "predict", str(export), "--images", str(scenes / "val"), "--out",
           str(tmp_path / "masks")]  # fmt: skip
    assert subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).returncode == 0
    assert len(list((tmp_path / "masks").glob("*.png"))) == 16
