"""`mimpipe evaluate` (finetune/report_card.py) on tiny ViTs and the synthetic shards: every measure is what the
pipeline's own code gives on the same encoder and images (the kNN monitor's embedding and vote, the L-BFGS probe,
few-shot, RankMe), checkpoints in one call give the rows each gives alone, an official-layout MAE file and our export
of it give the same row, a checkpoint of another width than `--arch` is refused before any image is embedded, the
command writes report.md, report.json and TensorBoard scalars, and with --card each export's numbers into its model
card's Evaluation section."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import finetune.report_card as report_card
from core.engine.distributed import DistInfo
from core.export.card import CARD_NAME, split_card
from core.export.folder import export_model
from core.models.build import model_args
from core.report.collapse import effective_rank, normalised_std
from core.report.fewshot import fewshot_correct
from core.report.knn import KNNBank
from data.__main__ import main as data_main
from data.pipeline import make_eval_loader
from data.progress import Progress
from data.specs import resolve_shards
from data.transforms import eval_transform
from finetune.convert import convert
from finetune.lbfgs_probe import extract_features, probe
from finetune.report_card import Protocol, evaluate
from finetune.report_encoders import EncoderFlags
from finetune.report_files import write_card_sections
from finetune.seg_probe import SegSchedule, seg_probe
from pretrain.knn import embed
from tests.helpers.datasets import needs_fashion_mnist
from tests.helpers.models import tiny_vit
from tests.launching import REPO

DIST = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
MEAN, STD = (0.4, 0.45, 0.5), (0.25, 0.2, 0.3)
MAX_TRAIN, MAX_VAL = 96, 48
SHOTS = (1, 5)
FROM_CHECKPOINTS = EncoderFlags()  # no flags: every setting from the checkpoint


def protocol(shards, **changes) -> Protocol:
    base = Protocol(
        train=str(shards["train"]), val=str(shards["val"]), suite=("knn", "linear", "fewshot", "rank"),
        max_train=MAX_TRAIN, max_val=MAX_VAL, shots=SHOTS, batch_size=32,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def trained_like(seed: int):
    """A tiny ViT whose weights no fresh one has (so that a loading mistake shows), 32 wide, 16 px, 4 px patches."""
    vit = tiny_vit(seed)
    with torch.no_grad():
        for p in vit.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return vit


def write_export(vit, path, pooling_hint: str = "token", step: int = 7):
    manifest = {"method": "mae", "step": step, "pooling_hint": pooling_hint}
    data_config = {"mean": MEAN, "std": STD, "crop_pct": 1.0}
    return export_model(vit, path, model_args=model_args(vit), manifest=manifest, data_config=data_config)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return [write_export(trained_like(seed), root / f"export{seed}") for seed in (0, 1)]


def run(specs, shards, flags=FROM_CHECKPOINTS, **changes) -> dict:
    report = evaluate([str(s) for s in specs], protocol(shards, **changes), flags, DIST, num_workers=0)
    assert report is not None
    return report


def sorted_batch(spec, limit: int) -> dict:
    """The first `limit` images of `spec` as one batch, in the order of their keys, seen as the export shows them."""
    transform = eval_transform(16, MEAN, STD, crop_pct=1.0)
    loader = make_eval_loader(
        resolve_shards(spec), transform=transform, batch_size=1000, rank=0, world_size=1, num_workers=0,
        max_samples=limit,
    )  # fmt: skip
    batches = list(loader)
    keys = [key for b in batches for key in b["key"]]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__))
    images, labels = torch.cat([b["image"] for b in batches]), torch.cat([b["label"] for b in batches])
    return {"image": images[order], "label": labels[order], "normalise": batches[0]["normalise"]}


def test_every_measure_equals_the_existing_code_on_the_same_encoder_and_images(shards, exports):
    row = run(exports[:1], shards)["rows"][0]
    metrics = row["metrics"]
    vit = trained_like(0)
    train, val = sorted_batch(shards["train"], MAX_TRAIN), sorted_batch(shards["val"], MAX_VAL)

    # kNN, few-shot and rank: the pretraining monitor's embedding (L2-normalised class tokens) and its code
    monitor = {"dist": DIST, "precision": "fp32", "pooling": "cls", "image_shape": (3, 16, 16)}
    bank, bank_labels = embed(vit, [train], **monitor)
    queries, query_labels = embed(vit, [val], **monitor)
    top1, top5 = KNNBank(bank, bank_labels, 20, 0.07, 4).correct(queries, query_labels).tolist()
    assert metrics["knn/top1"] == pytest.approx(top1 / MAX_VAL) and metrics["knn/top5"] == pytest.approx(top5 / MAX_VAL)
    for shots in SHOTS:
        correct = fewshot_correct(bank, bank_labels, queries, query_labels, shots=shots, num_classes=4)
        assert metrics[f"fewshot/top1_{shots}shot"] == pytest.approx(float(correct.mean()) / MAX_VAL)
    assert metrics["features/effective_rank"] == pytest.approx(effective_rank(bank), rel=1e-5)
    assert metrics["features/std"] == pytest.approx(normalised_std(bank), rel=1e-5)

    # the L-BFGS probe on the class token and on the mean of the patch tokens
    (train_features, train_labels), (val_features, val_labels) = (
        extract_features(vit, [b], "fp32") for b in (train, val)
    )
    for pooling in ("cls", "mean"):
        expected = probe((train_features[pooling], train_labels), (val_features[pooling], val_labels), num_classes=4)
        assert metrics[f"linear/top1_{pooling}"] == pytest.approx(expected["top1"])
        assert row["details"][f"linear_{pooling}"]["weight_decay"] == expected["weight_decay"]
    assert 0.5 < metrics["knn/top1"] <= 1.0  # the synthetic classes separate (chance 0.25)
    assert row["settings"]["sources"] == {
        "num_heads": "config.json", "img_size": "checkpoint", "mean": "config.json", "std": "config.json",
        "crop_pct": "config.json", "pooling": "checkpoint's pooling hint",
    }  # fmt: skip


def test_two_checkpoints_in_one_call_give_the_rows_each_gives_alone(shards, exports):
    both = run(exports, shards)
    alone = [run([path], shards)["rows"][0] for path in exports]
    assert [row["metrics"] for row in both["rows"]] == [row["metrics"] for row in alone]
    assert both["rows"][0]["metrics"] != both["rows"][1]["metrics"]
    assert both["train_samples"] == MAX_TRAIN and both["val_samples"] == MAX_VAL


def official_mae(vit) -> dict:
    """models_mae.py's checkpoint: the encoder's timm keys, MAE's mask token and decoder beside them, under "model"."""
    state = {k: v.clone() for k, v in vit.state_dict().items()}
    decoder = {
        "mask_token": torch.zeros(1, 1, 16),
        "decoder_embed.weight": torch.randn(16, 32),
        "decoder_embed.bias": torch.zeros(16),
        "decoder_pos_embed": torch.zeros(1, 17, 16),
        "decoder_norm.weight": torch.ones(16),
        "decoder_norm.bias": torch.zeros(16),
        "decoder_pred.weight": torch.randn(48, 16),
        "decoder_pred.bias": torch.zeros(48),
    }
    return {"model": state | decoder, "epoch": 399}


def test_an_official_mae_file_and_our_export_of_it_give_the_same_row(shards, tmp_path):
    torch.save(official_mae(trained_like(2)), tmp_path / "mae_pretrain.pth")
    convert(tmp_path / "mae_pretrain.pth", tmp_path / "export", num_heads=2)
    report = run([tmp_path / "mae_pretrain.pth", tmp_path / "export"], shards, EncoderFlags(num_heads=2))

    official, ours = report["rows"]
    assert official["metrics"] == ours["metrics"]
    assert (official["settings"]["checkpoint_format"], ours["settings"]["checkpoint_format"]) == (
        "mae-pretrain", "mimpipe-export"
    )  # fmt: skip
    assert official["settings"]["sources"]["mean"] == "ImageNet (official weights)"
    assert ours["settings"]["sources"]["mean"] == "config.json"
    assert official["settings"]["mean"] == ours["settings"]["mean"]


def test_an_architecture_flag_applies_only_to_the_checkpoints_that_do_not_fix_it(shards, tmp_path, capsys):
    """`--num-heads 2` on [an official MAE file, our 4-head export]: the file is built with 2 heads, the export keeps
    its config.json's 4 (its row is the one it gives alone; one line says so); on the export alone the flag is
    refused, naming both values (core/export/architecture.py's rule for `model.init`)."""
    torch.save(official_mae(trained_like(2)), tmp_path / "mae_pretrain.pth")
    four_heads = tiny_vit(4, num_heads=4)
    with torch.no_grad():
        for p in four_heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export = write_export(four_heads, tmp_path / "export")
    alone = run([export], shards)["rows"][0]
    capsys.readouterr()

    official, ours = run([tmp_path / "mae_pretrain.pth", export], shards, EncoderFlags(num_heads=2))["rows"]
    assert ours["settings"] == alone["settings"]  # the metrics too, but for the last bits of a thread-count change:
    assert ours["metrics"] == pytest.approx(alone["metrics"], rel=1e-6)  # evaluate sets 1 thread after its first embed
    assert (ours["settings"]["model_args"]["num_heads"], ours["settings"]["sources"]["num_heads"]) == (4, "config.json")
    assert (official["settings"]["model_args"]["num_heads"], official["settings"]["sources"]["num_heads"]) == (
        2, "--num-heads"
    )  # fmt: skip
    assert (
        f"[mimpipe] evaluate {export}: --num-heads 2: {export} has num_heads 4 (config.json): the checkpoint's kept "
        "(the flag is for weights files)\n"
    ) in capsys.readouterr().out

    with pytest.raises(ValueError) as caught:
        run([export], shards, EncoderFlags(num_heads=2))
    assert str(caught.value) == (
        f"--num-heads 2: {export} has num_heads 4 (config.json); --num-heads applies only to a weights file, which "
        "does not fix it"
    )


def test_a_checkpoint_of_another_width_than_its_flags_is_refused_before_anything_is_embedded(
    shards, exports, tmp_path, monkeypatch, capsys
):
    def no_embedding(*args, **kwargs):
        raise AssertionError("an image was embedded")

    monkeypatch.setattr(report_card, "extract_features", no_embedding)
    monkeypatch.setattr(report_card, "init_distributed", lambda device: DIST)
    argv = [str(exports[0]), str(exports[1]), "--train", str(shards["train"]), "--val", str(shards["val"])]
    code = report_card.main([*argv, "--out", str(tmp_path / "out"), "--arch", "vit_small_patch16_224"])

    assert code == 2
    error = capsys.readouterr().err
    assert "vit_small_patch16_224 has embed_dim 384" in error and "has 32" in error and str(exports[0]) in error
    assert not (tmp_path / "out").exists()


def test_progress_shows_a_rate_and_time_left_while_embedding(shards, exports):
    stream = io.StringIO()
    times = iter(range(100))
    progress = Progress(MAX_TRAIN, "images", label="evaluate x", every_s=1, stream=stream, clock=lambda: next(times))
    loader = make_eval_loader(
        resolve_shards(shards["train"]), transform=eval_transform(16, MEAN, STD), batch_size=16, rank=0, world_size=1,
        num_workers=0, max_samples=MAX_TRAIN,
    )  # fmt: skip
    split = report_card._embed_split(trained_like(0), loader, DIST, "fp32", progress)

    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("evaluate x: 16/96 images (16%) in ") and "images/s, ~" in lines[0]
    assert split.keys == sorted(split.keys) and len(split.keys) == MAX_TRAIN


def test_an_encoder_without_a_class_token_is_measured_on_the_mean_only(shards, tmp_path):
    export = write_export(tiny_vit(3, class_token=False, global_pool="avg"), tmp_path / "export", pooling_hint="avg")
    with pytest.raises(ValueError, match="--pooling cls, but its vit_tiny_patch16_224 has no class token"):
        run([export], shards, EncoderFlags(pooling="cls"))
    report = run([export], shards, suite=("knn", "linear"))
    metrics = report["rows"][0]["metrics"]
    assert "linear/top1_mean" in metrics and "linear/top1_cls" not in metrics
    assert report["rows"][0]["settings"]["pooling"] == "mean"


def test_the_command_writes_the_table_the_json_and_tensorboard(shards, exports, tmp_path):
    """`mimpipe evaluate` as a user runs it: one process, the table printed and written, the same numbers in
    TensorBoard under the monitors' tags at the export's step."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "core.entry.cli", "evaluate", str(exports[0]), "--train", str(shards["train"])]
    cmd += ["--val", str(shards["val"]), "--out", str(out), "--max-train", "64", "--max-val", "32", "--shots", "1,5"]
    proc = subprocess.run([*cmd, "--precision", "fp32"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((out / "report.json").read_text())
    metrics = report["rows"][0]["metrics"]
    table = (out / "report.md").read_text()
    columns = table.split("| checkpoint", 1)[1].splitlines()[0]  # the header row
    assert [c.strip() for c in columns.split("|")[1:-1]] == [
        "kNN top-1", "linear cls", "linear mean", "1-shot", "5-shot", "rank"
    ]  # fmt: skip
    assert f"{metrics['knn/top1']:.4f}" in table and "Protocol:" in table and "k 20, temperature 0.07" in table
    assert f"{metrics['knn/top1']:.4f}" in proc.stdout
    runs = list((out / "tb").iterdir())
    assert len(runs) == 1
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    for tag in ("knn/top1", "linear/top1_cls", "fewshot/top1_5shot", "features/effective_rank"):
        (scalar,) = events.Scalars(tag)
        assert (scalar.step, scalar.value) == (7, pytest.approx(metrics[tag]))


def table_of(section: str) -> dict[str, str]:
    """A markdown table's first two columns, header row left out."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return {row[0]: row[1] for row in rows if len(row) > 1 and row[0] not in ("measure", "---")}


def test_card_writes_each_exports_numbers_into_its_model_card(shards, tmp_path, monkeypatch, capsys):
    export = write_export(trained_like(5), tmp_path / "export")
    torch.save(official_mae(trained_like(2)), tmp_path / "mae_pretrain.pth")
    before = (export / CARD_NAME).read_text()
    monkeypatch.setattr(report_card, "init_distributed", lambda device: DIST)
    argv = [str(export), str(tmp_path / "mae_pretrain.pth"), "--train", str(shards["train"])]
    argv += ["--val", str(shards["val"]), "--out", str(tmp_path / "out"), "--max-train", "64", "--max-val", "32"]
    argv += ["--suite", "knn,fewshot,rank", "--shots", "1,5", "--num-workers", "0", "--precision", "fp32"]
    argv += ["--num-heads", "2", "--card"]

    assert report_card.main(argv) == 0

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    metrics = report["rows"][0]["metrics"]
    card = (export / CARD_NAME).read_text()
    sections = dict(split_card(card)[2])
    table = table_of(sections["Evaluation"])
    assert set(table) == set(metrics) == {"knn/top1", "knn/top5", "fewshot/top1_1shot", "fewshot/top1_5shot",
                                          "features/effective_rank", "features/std"}  # fmt: skip
    for tag, value in metrics.items():  # report.md's precision: 4 decimals, the rank 1
        assert float(table[tag]) == round(value, 1 if tag == "features/effective_rank" else 4), tag
    assert "Protocol:" in sections["Evaluation"] and "- kNN: k 20, temperature 0.07" in sections["Evaluation"]
    assert "- this encoder: 16x16 px, crop 1, cls pooling" in sections["Evaluation"]
    assert {k: v for k, v in sections.items() if k != "Evaluation"} == dict(split_card(before)[2])  # the rest as it was
    assert card.startswith(split_card(before)[0])  # the front matter too
    out = capsys.readouterr().out
    assert f"[mimpipe] card: wrote the Evaluation section of {export / CARD_NAME}" in out
    assert f"[mimpipe] card: left {tmp_path / 'mae_pretrain.pth'} alone: a mae-pretrain checkpoint" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "mae_pretrain.pth", "out"]

    # an export replaced since it was measured, a run_dir's temporary export and a Hub repo are left alone
    newer = write_export(trained_like(6), tmp_path / "export", step=8)
    row = report["rows"][0]

    def moved(checkpoint: str, path: str) -> dict:
        return {**row, "checkpoint": checkpoint, "settings": {**row["settings"], "path": path}}

    rows = [row, moved("runs/x", str(tmp_path / "gone")), moved("hf-hub:org/vit", "hf-hub:org/vit")]
    lines, failed = write_card_sections({**report, "rows": rows})
    assert failed == 0 and "## Evaluation" not in (newer / CARD_NAME).read_text()
    assert lines[0] == (
        f"[mimpipe] card: left {export} alone: {export} was replaced since it was measured (step 7, now 8): "
        "evaluate it again"
    )  # fmt: skip
    assert "left runs/x alone: measured from a temporary export" in lines[1]
    assert "left hf-hub:org/vit alone: a Hub repo" in lines[2]


@needs_fashion_mnist
def test_the_segmentation_probe_trains_the_linear_head_on_the_frozen_encoder(tmp_path):
    """Two steps of the linear head on Fashion-MNIST scenes (finetune/seg_probe.py): the encoder is left as loaded,
    and every validation image is scored."""
    for split, num in (("train", 8), ("val", 4)):
        args = ["--split", split, "--num-samples", str(num), "--out", str(tmp_path / split), "--shard-size", "4"]
        data_main(["write", "--source", "fashion-mnist-scenes", *args])
    vit = tiny_vit(4, img_size=32)
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    metrics = seg_probe(
        vit, train=str(tmp_path / "train"), val=str(tmp_path / "val"), crop=(32, 32), mean=MEAN, std=STD, dist=DIST,
        precision="fp32", num_workers=0, schedule=SegSchedule(steps=2, batch_size=4, warmup_steps=1),
    )  # fmt: skip
    assert metrics["seg/images"] == 4 and 0.0 <= metrics["seg/miou"] <= 1.0
    assert all(torch.equal(before[k], v) for k, v in vit.state_dict().items())
