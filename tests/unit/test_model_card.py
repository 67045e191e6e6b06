"""The model card of every export (core/export/card.py): a Hub card whose metadata parses and types right, the folder
it sits in still loads in timm, the run's facts (shards, steps, monitors at the exported step, what its init was) in
its body, a title that names the model as built, one license in config.json and the card that survives a re-save by
huggingface_hub, `mimpipe evaluate`'s section put in and replaced whole, and metrics.jsonl read at a cost that does not
grow with the run."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard import metadata_load

from core.export import card_facts
from core.export import folder as folder_module
from core.export.card import CARD_NAME, render_card, split_card, update_card_evaluation
from core.export.card_facts import InitFacts, last_values, run_facts
from core.export.card_names import init_origin
from core.export.folder import export_model, export_state_dict
from core.export.handoff import load_encoder
from core.models.build import build_model
from core.recipe.config import dump_config, load_config
from data.__main__ import main as data_main
from finetune.convert import convert
from tests.helpers.fake_hub import metadata_errors
from tests.helpers.models import WIDE, wide_vit

ARGS = {**WIDE, "mlp_ratio": 4.0, "global_pool": "token"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """16 px synthetic shards whose index.json says they were written from Fashion-MNIST (as --source fashion-mnist
    writes it), 32 samples in 2 shards."""
    out = tmp_path_factory.mktemp("shards") / "train"
    args = ["--num-samples", "32", "--image-size", "16", "--num-classes", "4", "--shard-size", "16"]
    data_main(["write", "--source", "synthetic", "--out", str(out), *args])
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps(index | {"source": "fashion-mnist"}))
    return out


def pretrain_cfg(tmp_path: Path, shards: Path):
    overrides = [f"data.train={shards}", f"run_dir={tmp_path / 'run'}", "model.img_size=16", "data.global_batch_size=8"]
    return load_config("recipes/quickstart.yaml", overrides)


def write_metrics(path: Path, num_steps: int, *, every: int = 50) -> None:
    """A pretraining run's metrics.jsonl: train/loss at every step, the kNN and few-shot monitors every `every`."""
    with open(path, "w") as f:
        for step in range(1, num_steps + 1):
            f.write(json.dumps({"step": step, "time": 0.0, "train/loss": 1 / step, "train/lr": 1e-3}) + "\n")
            if step % every == 0:
                knn = {"knn/top1": step / 1e4, "knn/top5": 0.9, "fewshot/top1_5shot": 0.3, "fewshot/top1_10shot": 0.4}
                f.write(json.dumps({"step": step, "time": 0.0, **knn, "fewshot/seconds": 1.0}) + "\n")
                f.write(json.dumps({"step": step, "time": 0.0, "features/effective_rank": 7.5}) + "\n")


def test_pretraining_card_parses_as_a_hub_card_and_timm_still_loads_the_folder(tmp_path, shards):
    cfg = pretrain_cfg(tmp_path, shards)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_metrics(run_dir / "metrics.jsonl", 120)
    (run_dir / "metrics.jsonl").open("a").write('{"step": 121, "train/lo')  # a line cut short by a kill
    model = build_model(cfg, num_classes=0)
    manifest = {"method": "mae", "step": 100, "config": cfg.model_dump(mode="json"), "pooling_hint": "avg"}

    out = export_state_dict(
        cfg, model.state_dict(), run_dir / "export", num_classes=0, manifest=manifest, run_dir=run_dir
    )

    card = ModelCard.load(out / CARD_NAME)
    assert metadata_load(out / CARD_NAME) == card.data.to_dict()
    meta = card.data.to_dict()
    assert meta == {
        "library_name": "timm",
        "pipeline_tag": "image-feature-extraction",
        "tags": ["image-feature-extraction", "mae", "mimpipe"],
        "datasets": ["zalando-datasets/fashion_mnist"],
    }
    assert ModelCardData(**meta).to_dict() == meta and metadata_errors(str(card)) == []
    front = (out / CARD_NAME).read_text().split("\n---\n")[0]
    assert "license" not in front  # not set: said in the body only (a YAML comment would not survive a re-save)
    body = card.text
    assert "## License\n\nNot set: neither the front matter above (`license:`) nor config.json" in body
    assert "# ViT (128 wide, 4 blocks, patch 4, 16 px) pretrained with MAE\n" in body
    assert f'timm.create_model("local-dir:{out}", pretrained=True)' in body
    assert f"- Data (train): `{shards}`: 2 shards, 32 samples, written from fashion-mnist (split train)" in body
    assert "- Steps: exported at optimizer step 100 of 700, global batch 8 (800 samples seen)" in body
    assert "- Objective: `mae` (mask_ratio 0.75, norm_pix_loss true, decoder_embed_dim 96" in body
    rows = [line for line in body.splitlines() if line.startswith("| ") and "monitor" not in line]
    assert rows == [
        "| train/loss | 0.01 | 100 |",  # the exported step's, not the run's last (120)
        "| knn/top1 | 0.01 | 100 |",
        "| fewshot/top1_5shot | 0.3 | 100 |",
        "| fewshot/top1_10shot | 0.4 | 100 |",
        "| features/effective_rank | 7.5 | 100 |",
    ]
    assert body.split("```yaml\n")[1].split("```")[0] == dump_config(cfg)  # the run's config.yaml, whole
    assert "## Evaluation" not in body  # no placeholder until `mimpipe evaluate` ran

    loaded = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_finetuning_segmentation_and_converted_cards_name_their_task(tmp_path):
    config = {"architecture": "vit_tiny_patch16_224", "num_classes": 3, "model_args": {"img_size": 16}}
    finetune = {"method": "finetune", "mode": "linear_probe", "step": 40, "classes": ["a", "b", "c"],
                "metrics": {"val/top1": 0.75, "val/top5": 1.0},
                "config": {"model": {"init": "hf-hub:org/encoder@v1"}, "data": {"global_batch_size": 4}}}  # fmt: skip
    text = render_card(config, finetune, location="local-dir:x", files=["config.json"])
    meta = ModelCard(text).data.to_dict()
    assert meta["pipeline_tag"] == "image-classification" and meta["base_model"] == "org/encoder"
    assert "# ViT (192 wide, 12 blocks, patch 16, 16 px) linear probe for image classification (3 classes)" in text
    assert "| val/top1 | 0.75 | 40 |" in text and "val/top5" not in text  # the exported weights' own score
    assert "- Classifier: 3 classes: a, b, c" in text and "(the best evaluation so far)" in text

    seg = {"method": "segmentation", "segmentation": {"head": "upernet", "num_classes": 3, "aux": True,
           "channels": 32, "head_file": "seg_head.safetensors"}}  # fmt: skip
    text = render_card({**config, "num_classes": 0}, seg, location="local-dir:x", files=["seg_head.safetensors"])
    assert ModelCard(text).data.pipeline_tag == "image-segmentation"
    assert "upernet (channels 32, auxiliary FCN head); its weights are `seg_head.safetensors`" in text

    source = tmp_path / "mae.safetensors"
    state = wide_vit().state_dict() | {"mask_token": torch.zeros(1, 1, 64)}
    safetensors.torch.save_file(state, source)
    convert(source, tmp_path / "converted", num_heads=4)
    card = ModelCard.load(tmp_path / "converted" / CARD_NAME)
    assert card.data.tags == ["image-feature-extraction", "mae", "mimpipe"] and metadata_errors(str(card)) == []
    assert f"- Converted from `{source}` (a mae-pretrain checkpoint); 1 tensors left out" in card.text
    assert timm.create_model(f"local-dir:{tmp_path / 'converted'}", pretrained=True).embed_dim == 64


def test_evaluation_section_is_put_in_its_place_and_replaced_whole(tmp_path):
    out = export_model(wide_vit(), tmp_path / "export", model_args=ARGS, manifest={"method": "mae", "step": 5})
    front = (out / CARD_NAME).read_text().split("\n---\n")[0]

    update_card_evaluation(out, "| probe | top1 |\n|---|---|\n| knn | 0.50 |")
    update_card_evaluation(out, "| probe | top1 |\n|---|---|\n| knn | 0.61 |\n| linear | 0.70 |\n")

    text = (out / CARD_NAME).read_text()
    assert text.startswith(front) and text.count("## Evaluation") == 1 and "0.50" not in text
    headings = [heading for heading, _ in split_card(text)[2]]
    assert headings == ["Use it in timm", "Model", "Evaluation", "Files", "License"]
    evaluation = dict(split_card(text)[2])["Evaluation"]
    assert evaluation.strip().endswith("| knn | 0.61 |\n| linear | 0.70 |")
    assert ModelCard(text).data.library_name == "timm"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "mimpipe.json", "model.safetensors"]

    export_model(wide_vit(seed=1), out, model_args=ARGS, manifest={"method": "mae", "step": 6})  # new weights
    assert "## Evaluation" not in (out / CARD_NAME).read_text()


def test_an_export_from_before_cards_gets_one_with_its_evaluation(tmp_path):
    out = export_model(wide_vit(), tmp_path / "export", model_args=ARGS, manifest={"method": "simmim", "step": 5})
    (out / CARD_NAME).unlink()

    update_card_evaluation(out, "| probe | top1 |\n|---|---|\n| knn | 0.5 |")

    card = ModelCard.load(out / CARD_NAME)
    assert card.data.tags == ["image-feature-extraction", "simmim", "mimpipe"] and "| knn | 0.5 |" in card.text
    with pytest.raises(ValueError, match="not a mimpipe export"):
        update_card_evaluation(tmp_path, "| a |")


def test_a_failed_card_leaves_the_previous_export_whole(tmp_path, monkeypatch):
    out = export_model(wide_vit(), tmp_path / "export", model_args=ARGS, manifest={"method": "mae", "step": 1})
    before = (out / CARD_NAME).read_text()

    def crash(folder, **kwargs):
        (folder / CARD_NAME).write_text("---\nlibrary_na")
        raise OSError("disk full")

    monkeypatch.setattr(folder_module, "write_card", crash)
    with pytest.raises(OSError, match="disk full"):
        export_model(wide_vit(seed=2), out, model_args=ARGS, manifest={"method": "mae", "step": 2})

    assert (out / CARD_NAME).read_text() == before and "step 1" in before
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_run_facts_without_shards_or_metrics_leave_them_out(tmp_path, shards):
    cfg = pretrain_cfg(tmp_path, shards)
    cfg.data.train = str(tmp_path / "gone")
    facts = run_facts(cfg, run_dir=tmp_path / "no_run", step=5)
    assert facts.monitors == {} and facts.data[0].num_samples is None and facts.data[0].dataset is None
    text = render_card({"architecture": "vit"}, {"method": "mae", "step": 5, "config": cfg.model_dump(mode="json")},
                       location="local-dir:x", files=[], facts=facts)  # fmt: skip
    assert f"- Data (train): `{tmp_path / 'gone'}`\n" in text and "## Monitors" not in text
    assert "datasets" not in ModelCard(text).data.to_dict()


def test_reading_the_monitors_costs_the_same_however_long_the_run(tmp_path, monkeypatch):
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(card_facts.json, "loads", lambda text: parsed.append(1) or real_loads(text))
    expected = ("train/loss", "knn/top1", "fewshot/top1_", "features/effective_rank")
    counts, values = [], []
    for num_steps in (1_000, 20_000):
        path = tmp_path / f"metrics_{num_steps}.jsonl"
        write_metrics(path, num_steps)
        parsed.clear()
        values.append(last_values(path, expected, upto=None))
        counts.append(len(parsed))
    assert counts[0] == counts[1] <= 4  # the last line of each monitor, whatever the length
    assert values[1]["train/loss"] == (20_000, 1 / 20_000) and values[1]["knn/top1"] == (20_000, 2.0)


def title_of(config: dict, manifest: dict) -> str:
    return render_card(config, manifest, location="x", files=[]).split("\n# ", 1)[1].splitlines()[0]


def test_the_title_names_the_model_as_built(tmp_path):
    out = export_model(wide_vit(), tmp_path / "export", model_args=ARGS, manifest={"method": "mae", "step": 5})

    assert json.loads((out / "config.json").read_text())["architecture"] == "vit_tiny_patch16_224"  # timm's name
    assert ModelCard.load(out / CARD_NAME).text.strip().splitlines()[0] == (
        "# ViT (64 wide, 2 blocks, patch 4, 28 px) pretrained with MAE"
    )  # fmt: skip
    base = {"img_size": [224, 224], "patch_size": [16, 16], "embed_dim": 768, "depth": 12, "num_heads": 12}
    vit_b = {"architecture": "vit_base_patch16_224", "model_args": base}
    assert title_of(vit_b, {"method": "mae"}) == "vit_base_patch16_224 pretrained with MAE"  # the name is the model
    deit = {"architecture": "deit_tiny_distilled_patch16_224", "model_args": {"img_size": [28, 32], "patch_size": 4}}
    expected = "DeiT distilled (192 wide, 12 blocks, patch 4, 28x32 px) pretrained with SimMIM"
    assert title_of(deit, {"method": "simmim"}) == expected
    hybrid = {"architecture": "vit_small_r26_s32_224", "model_args": {"img_size": 64}}
    assert title_of(hybrid, {"method": "beit"}) == "vit_small_r26_s32_224 pretrained with BEiT"  # not spelt out


@pytest.mark.parametrize("license_id", [None, "cc-by-nc-4.0"])
def test_the_license_is_one_thing_in_config_json_and_the_card_and_survives_a_resave(tmp_path, license_id):
    manifest = {"method": "mae", "step": 5}
    out = export_model(wide_vit(), tmp_path / "export", model_args=ARGS, manifest=manifest, license_id=license_id)

    pretrained_cfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert pretrained_cfg.get("license") == license_id  # not the registry's apache-2.0 (timm's released weights')
    assert not set(pretrained_cfg) & set(folder_module.SOURCE_WEIGHTS_KEYS) - {"license"}
    update_card_evaluation(out, "| measure | value |\n|---|---|\n| knn/top1 | 0.5000 |")
    text = (out / CARD_NAME).read_text()
    assert ModelCard(text).data.to_dict().get("license") == license_id and metadata_errors(text) == []
    section = dict(split_card(text)[2])["License"].strip()
    expected = f"`{license_id}` (the front matter's `license:`" if license_id else "Not set: neither the front matter"
    assert section.startswith(expected) and "carry the terms of the data" in section

    ModelCard.load(out / CARD_NAME).save(out / CARD_NAME)  # what a script or the Hub's tooling may do with a card

    assert (out / CARD_NAME).read_text() == text  # license, License section, Evaluation: all as they were
    with pytest.raises(ValueError, match="license 'Apache 2.0'"):
        export_model(wide_vit(), tmp_path / "other", model_args=ARGS, manifest=manifest, license_id="Apache 2.0")


def finetune_export(tmp_path: Path, shards: Path, init: Path) -> Path:
    """A fine-tuning run's best export (finetune/best.py's manifest) of a recipe whose `model.init` is `init`."""
    run_dir = tmp_path / "finetune"
    overrides = [f"model.init={init}", f"data.train={shards}", f"data.val={shards}", f"run_dir={run_dir}"]
    overrides += ["model.embed_dim=64", "model.depth=2", "model.num_heads=4"]
    cfg = load_config("recipes/quickstart_finetune.yaml", overrides)
    manifest = {"method": "finetune", "mode": cfg.objective.mode, "step": 40, "source": cfg.model.init,
                "metrics": {"val/top1": 0.5}, "config": cfg.model_dump(mode="json"), "pooling_hint": "avg"}  # fmt: skip
    state = build_model(cfg, num_classes=4).state_dict()
    export_state_dict(cfg, state, run_dir / "export", num_classes=4, manifest=manifest, run_dir=run_dir)
    return run_dir


def test_a_finetuning_card_names_the_pretraining_it_started_from(tmp_path, shards):
    init = export_model(wide_vit(), tmp_path / "pretrain", model_args=ARGS, manifest={"method": "mae", "step": 300})

    run_dir = finetune_export(tmp_path, shards, init)
    assert f"- Started from: `{init}` (MAE pretraining, step 300)\n" in (run_dir / "export" / CARD_NAME).read_text()

    # the hand-off's record (run_dir/load_report.json, as finetune/handoff.py writes it) says what was loaded, even
    # once the init export is replaced; without one, the init's mimpipe.json says what it is now
    (run_dir / "load_report.json").write_text(json.dumps(load_encoder(wide_vit(seed=1), init).as_dict()))
    export_model(wide_vit(), init, model_args=ARGS, manifest={"method": "simmim", "step": 500})
    finetune_export(tmp_path, shards, init)
    assert f"- Started from: `{init}` (MAE pretraining, step 300)\n" in (run_dir / "export" / CARD_NAME).read_text()
    (run_dir / "load_report.json").unlink()
    finetune_export(tmp_path, shards, init)
    assert f"`{init}` (SimMIM pretraining, step 500)\n" in (run_dir / "export" / CARD_NAME).read_text()

    official = InitFacts("hf-hub:org/mae", checkpoint_format="mae-pretrain")  # a load report's file without manifest
    assert init_origin(official) == "MAE pretraining, official checkpoint layout"
    converted = InitFacts("x", "mimpipe-export", {"method": "convert", "source_manifest": {"method": "data2vec2"}})
    assert init_origin(converted) == "data2vec 2.0 pretraining, converted by mimpipe"
