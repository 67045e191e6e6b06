"""Recipe schema: strictness, hints, overrides, recipes in recipes/, batch/lr/step arithmetic."""

from pathlib import Path

import pytest
import yaml

from core.export.architecture import resolve_architecture
from core.export.folder import export_model
from core.models.build import build_model, model_args
from core.recipe.config import ConfigError, dump_config, load_config
from data.shard_read import ShardReadPolicy

RECIPES = sorted(Path(__file__).resolve().parents[2].glob("recipes/*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_starts_with_its_command(recipe):
    cfg = load_config(recipe)
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("#") and "launch.sh" in first
    assert cfg.peak_lr > 0


# What each published recipe's header comment promises: stage, model, objective, global batch, peak lr (after the
# lr rule), ZeRO stage and length in optimizer steps (epochs of ImageNet-1k's 1,281,167 images where given so). A recipe
# that starts from the quickstart's export states only what it changes: its model is what its stage resolves, from an
# export of recipes/quickstart.yaml's encoder (`published`).
SHAPE = ("stage", "model.size", "model.img_size", "model.patch_size", "objective.kind")
PUBLISHED = {
    "beit_vitb": (("pretrain", "base", 224, 16, "beit"), 2048, 1.5e-3, 1, (500456, 6256)),
    "finetune_deit_distill": (
        ("finetune", "base", 224, 16, "classification"),
        1024,
        5e-4 * 1024 / 512,
        1,
        (375342, 6256),
    ),
    "finetune_vitb": (("finetune", "base", 224, 16, "classification"), 1024, 5e-4 * 1024 / 256, 1, (125114, 6256)),
    "finetune_vith": (("finetune", "huge", 224, 14, "classification"), 1024, 1e-3 * 1024 / 256, 2, (62557, 6256)),
    "finetune_vitl": (("finetune", "large", 224, 16, "classification"), 1024, 1e-3 * 1024 / 256, 1, (62557, 6256)),
    "linprobe_vitl": (("finetune", "large", 224, 16, "classification"), 16384, 0.1 * 16384 / 256, 1, (3910, 782)),
    "data2vec2_vitb": (("pretrain", "base", 224, 16, "data2vec2"), 256, 1e-3, 1, (375300, 50040)),
    "data2vec2_vitl": (("pretrain", "large", 224, 16, "data2vec2"), 128, 4e-4, 1, (375300, 50040)),
    "quickstart_data2vec2": (("pretrain", "tiny", 28, 4, "data2vec2"), 256, 1.5e-3, 1, (250, 25)),
    "ijepa_vith14": (("pretrain", "huge", 224, 14, "ijepa"), 2048, 1e-3, 2, (187671, 25023)),
    "ijepa_vitb16": (("pretrain", "base", 224, 16, "ijepa"), 2048, 1e-3, 1, (187671, 25023)),
    "quickstart_ijepa": (("pretrain", "tiny", 28, 4, "ijepa"), 256, 1.5e-3, 1, (400, 40)),
    "mae_vitb": (("pretrain", "base", 224, 16, "mae"), 4096, 1.5e-4 * 4096 / 256, 1, (250228, 12512)),
    "mae_vith": (("pretrain", "huge", 224, 14, "mae"), 4096, 1.5e-4 * 4096 / 256, 2, (250228, 12512)),
    "mae_vitl": (("pretrain", "large", 224, 16, "mae"), 4096, 1.5e-4 * 4096 / 256, 1, (250228, 12512)),
    "quickstart": (("pretrain", "tiny", 28, 4, "mae"), 256, 1.5e-3, 1, (700, 70)),
    "quickstart_beit": (("pretrain", "tiny", 28, 4, "beit"), 256, 1.5e-3, 1, (350, 35)),
    "quickstart_distill": (("finetune", "tiny", 28, 4, "classification"), 128, 5e-3 * 128 / 256, 1, (1000, 50)),
    "quickstart_finetune": (("finetune", "tiny", 28, 4, "classification"), 128, 5e-3 * 128 / 256, 1, (1000, 50)),
    "quickstart_finetune_full": (("finetune", "tiny", 32, 4, "classification"), 64, 8e-3 * 64 / 256, 1, (2000, 100)),
    "quickstart_seg": (("finetune", "tiny", 64, 4, "segmentation"), 32, 4e-3 * 32 / 256, 1, (600, 50)),
    "seg_upernet_vitb_ade20k": (("finetune", "base", 512, 16, "segmentation"), 16, 1e-4, 1, (160000, 1500)),
    "seg_linear_vitb_ade20k": (("finetune", "base", 512, 16, "segmentation"), 16, 1e-3, 1, (40000, 1500)),
    "seg_vtfpn_r50_ade20k": (("finetune", "base", 512, 16, "segmentation"), 16, 0.01, 1, (80000, 0)),  # ResNet-50
    "quickstart_linprobe": (("finetune", "tiny", 28, 4, "classification"), 256, 0.1, 1, (500, 50)),
    "quickstart_mpp": (("pretrain", "tiny", 28, 4, "beit"), 256, 1.5e-3, 1, (350, 35)),
    "quickstart_tokenizer": (("tokenizer", "base", 224, 16, "vqvae"), 128, 2e-3, 1, (500, 25)),  # model unused
    "tokenizer_in1k": (("tokenizer", "base", 224, 16, "vqvae"), 1024, 1e-3, 1, (25023, 1252)),  # model unused
    "vit_mpp_vitb": (("pretrain", "base", 224, 16, "beit"), 4096, 2e-4, 1, (93836, 10000)),
    "quickstart_hybrid": (("finetune", "tiny", 32, 2, "classification"), 128, 5e-3 * 128 / 256, 1, (1000, 50)),
    # T2T-ViT and VT-ResNet use neither model.size nor model.patch_size (their variants and stems say)
    "quickstart_t2t": (("finetune", "base", 64, 16, "classification"), 128, 5e-3 * 128 / 256, 1, (1000, 50)),
    "quickstart_vt": (("finetune", "base", 32, 16, "classification"), 128, 5e-3 * 128 / 256, 1, (1000, 50)),
    "quickstart_simmim": (("pretrain", "tiny", 28, 4, "simmim"), 256, 1.5e-3, 1, (700, 70)),
    "t2t_vit14": (("finetune", "base", 224, 16, "classification"), 512, 5e-4, 1, (750684, 12512)),
    "vt_resnet18": (("finetune", "base", 224, 16, "classification"), 256, 0.1, 1, (450411, 0)),
}
# Per recipe, the settings that tell its variant apart (objective target, probe mode, distillation, tokenizer grid).
VARIANT = {
    "beit_vitb": {"objective.target.kind": "tokenizer", "model.layer_scale_init": 0.1, "objective.mask.num_masked": 75},
    "finetune_deit_distill": {"distill.kind": "hard", "model.global_pool": "token", "distill.alpha": 0.5},
    "finetune_vitb": {"model.global_pool": "avg", "optim.layer_decay": 0.65, "model.drop_path_rate": 0.1},
    "finetune_vith": {"model.global_pool": "avg", "model.drop_path_rate": 0.3},
    "finetune_vitl": {"model.global_pool": "avg", "optim.layer_decay": 0.75, "model.drop_path_rate": 0.2},
    "linprobe_vitl": {"objective.mode": "linear_probe", "optim.kind": "lars", "optim.weight_decay": 0.0},
    "mae_vitb": {"objective.mask_ratio": 0.75, "objective.decoder_embed_dim": 512, "objective.decoder_depth": 8},
    "mae_vith": {"objective.mask_ratio": 0.75, "objective.decoder_embed_dim": 512, "objective.decoder_depth": 8},
    "data2vec2_vitb": {"objective.num_masks": 16, "objective.top_k_blocks": 10, "objective.decoder.kernel_size": 3},
    "data2vec2_vitl": {"objective.num_masks": 16, "objective.top_k_blocks": 18, "objective.decoder.kernel_size": 5},
    "quickstart_data2vec2": {"objective.num_masks": 4, "objective.top_k_blocks": 3, "objective.mask_block": 2},
    "ijepa_vith14": {"objective.predictor.depth": 12, "optim.weight_decay_end": 0.4, "data.hflip": 0.0},
    "ijepa_vitb16": {"objective.predictor.depth": 6, "model.class_token": False, "data.crop_scale": (0.3, 1.0)},
    "quickstart_ijepa": {"objective.predictor.embed_dim": 64, "model.class_token": False, "objective.min_keep": 6},
    "mae_vitl": {"objective.mask_ratio": 0.75, "objective.norm_pix_loss": True, "optim.betas": (0.9, 0.95)},
    "quickstart": {"model.embed_dim": 128, "model.depth": 4, "objective.decoder_embed_dim": 96},
    "quickstart_beit": {"model.embed_dim": 128, "objective.target.kind": "tokenizer", "objective.mask.num_masked": 20},
    "quickstart_distill": {"distill.kind": "hard", "model.global_pool": "token"},
    "quickstart_finetune": {"model.global_pool": "avg", "optim.layer_decay": 0.85, "augment.re_prob": 0.1},
    "quickstart_finetune_full": {"optim.layer_decay": 0.75, "augment.mixup": 0.8, "augment.cutmix": 1.0},
    "quickstart_seg": {"objective.head": "upernet", "objective.channels": 64, "optim.layer_decay": 0.75},
    "seg_upernet_vitb_ade20k": {
        "objective.head": "upernet",
        "objective.channels": 768,
        "objective.aux_weight": 0.4,
        "objective.eval_mode": "slide",
        "objective.eval_stride": 341,
        "objective.base_size": 512,
        "optim.layer_decay": 0.65,
        "optim.weight_decay": 0.05,
        "model.drop_path_rate": 0.1,
    },  # fmt: skip
    "seg_linear_vitb_ade20k": {
        "objective.head": "linear",
        "objective.freeze_encoder": True,
        "objective.aux_weight": 0.0,
    },
    "seg_vtfpn_r50_ade20k": {
        "model.arch": "resnet",
        "model.resnet_variant": 50,
        "objective.head": "vt_fpn",
        "objective.channels": 256,
        "optim.kind": "sgd",
    },
    "quickstart_linprobe": {"objective.mode": "linear_probe", "optim.kind": "lars", "model.global_pool": "token"},
    "quickstart_mpp": {"objective.target.kind": "mean_color_3bit", "objective.corruption": "mixed"},
    "quickstart_tokenizer": {"objective.img_size": 28, "objective.downsample": 4, "objective.codebook_size": 256},
    "tokenizer_in1k": {"objective.img_size": 112, "objective.downsample": 8, "objective.codebook_size": 8192},
    "vit_mpp_vitb": {"objective.target.kind": "mean_color_3bit", "objective.corruption": "mixed"},
    "quickstart_hybrid": {"model.arch": "vit_hybrid", "model.hybrid_backbone": "resnet_stem"},
    "quickstart_t2t": {"model.arch": "t2t_vit", "model.t2t_variant": "t_14"},
    "quickstart_vt": {"model.arch": "vt_resnet", "model.vt_variant": 18},
    "quickstart_simmim": {"model.arch": "vit", "objective.mask_ratio": 0.6},
    "t2t_vit14": {"model.arch": "t2t_vit", "model.t2t_variant": "14"},
    "vt_resnet18": {"model.arch": "vt_resnet", "model.vt_variant": 18, "optim.kind": "sgd"},
}


def _get(cfg, dotted: str):
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return tuple(cfg) if isinstance(cfg, list) else cfg


def test_the_table_covers_every_published_recipe():
    assert set(PUBLISHED) == set(VARIANT) == {p.stem for p in RECIPES}


QUICKSTART_EXPORT = "runs/quickstart/export"


@pytest.fixture(scope="module")
def quickstart_export(tmp_path_factory) -> Path:
    """What recipes/quickstart.yaml exports (its encoder's config.json, normalisation and manifest), random weights."""
    cfg = load_config(RECIPES[0].parent / "quickstart.yaml")
    model = build_model(cfg)
    out = tmp_path_factory.mktemp("quickstart") / "export"
    manifest = {"method": "mae", "step": 700, "config": cfg.model_dump(mode="json"), "pooling_hint": "avg"}
    data_config = {"mean": cfg.data.mean, "std": cfg.data.std}
    return export_model(model, out, model_args=model_args(model), manifest=manifest, data_config=data_config)


def published(name: str, quickstart_export: Path):
    """A published recipe as its stage sees it: one that starts from the quickstart's export is completed from
    `quickstart_export` (core/export/architecture.py), the others as they load."""
    path = RECIPES[0].parent / f"{name}.yaml"
    cfg = load_config(path)
    if cfg.model.init == QUICKSTART_EXPORT:
        cfg = load_config(path, [f"model.init={quickstart_export}"])
        resolve_architecture(cfg)
    return cfg


@pytest.mark.parametrize("name", PUBLISHED)
def test_each_published_recipe_loads_with_its_promised_size_objective_batch_and_lr(name, quickstart_export):
    cfg = published(name, quickstart_export)
    shape, batch, peak_lr, zero_stage, steps = PUBLISHED[name]
    assert tuple(_get(cfg, key) for key in SHAPE) == shape
    assert cfg.data.global_batch_size == batch
    assert cfg.peak_lr == pytest.approx(peak_lr)
    assert (cfg.engine.zero_stage, cfg.engine.precision) == (zero_stage, "auto")  # what each machine runs fastest
    assert cfg.steps(cfg.data.samples_per_epoch) == steps
    assert {key: _get(cfg, key) for key in VARIANT[name]} == VARIANT[name]


def test_encoder_recipes_build_the_arch_they_name():
    expected = {
        "quickstart_hybrid.yaml": ("vit_hybrid", (4, 4), "classification"),
        "quickstart_t2t.yaml": ("t2t_vit", (4, 4), "classification"),
        "quickstart_vt.yaml": ("vt_resnet", (2, 2), "classification"),
        "quickstart_simmim.yaml": ("vit", (7, 7), "simmim"),
        "t2t_vit14.yaml": ("t2t_vit", (14, 14), "classification"),
        "vt_resnet18.yaml": ("vt_resnet", (14, 14), "classification"),
    }
    for name, (arch, grid, kind) in expected.items():
        cfg = load_config(RECIPES[0].parent / name)
        assert (cfg.model.arch, cfg.model.grid, cfg.objective.kind) == (arch, grid, kind), name
    t2t = load_config(RECIPES[0].parent / "t2t_vit14.yaml")
    assert t2t.peak_lr == 5e-4 and t2t.data.global_batch_size == 512 and t2t.schedule.epochs == 300


def test_mae_vitl_is_the_paper_recipe():
    cfg = load_config(RECIPES[0].parent / "mae_vitl.yaml")
    assert cfg.data.global_batch_size == 4096
    assert cfg.peak_lr == pytest.approx(2.4e-3)
    assert cfg.steps(1281167) == (250228, 12512)  # 800 and 40 epochs of ImageNet-1k at 4096
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.weight_decay == 0.05 and cfg.optim.grad_clip == 0
    assert cfg.objective.mask_ratio == 0.75 and cfg.objective.norm_pix_loss
    assert (cfg.engine.precision, cfg.engine.zero_stage) == ("auto", 1)
    assert (cfg.model.size, cfg.model.patch_size) == ("large", 16)


def test_base_recipe_is_merged_and_overridden():
    cfg = load_config(RECIPES[0].parent / "mae_vith.yaml")
    assert (cfg.model.size, cfg.model.patch_size, cfg.model.img_size) == ("huge", 14, 224)
    assert cfg.engine.zero_stage == 2 and cfg.data.global_batch_size == 4096


SEG = ["stage=finetune", "objective.kind=segmentation"]
SEG_FPN = [*SEG, "objective.head=fpn", "model.arch=resnet"]


def test_a_resnet_takes_the_fpn_heads_at_their_width():
    cfg = load_config(None, SEG_FPN + ["model.resnet_variant=18", "engine.zero_stage=2"])
    assert cfg.model.resnet_variant == 18 and cfg.objective.channels is None  # the head's default (256)


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["optim.base_rl=1e-3"], "optim.base_rl: unknown key (did you mean 'base_lr'?)"),
        (["objective.mask_ratoi=0.5"], "objective.mask_ratoi: unknown key (did you mean 'mask_ratio'?)"),
        (["modle.size=base"], "modle: unknown key (did you mean 'model'?)"),
        (["objective.mask_ratio=1.0"], "objective.mask_ratio"),
        (["objective.mask_ratio=0"], "objective.mask_ratio"),
        (["model.img_size=30"], "not divisible by model.patch_size"),
        (["data.global_batch_size=abc"], "data.global_batch_size"),
        (["data.global_batch_size=10", "engine.grad_accum_steps=3"], "engine.grad_accum_steps"),
        (["engine.zero_stage=4"], "engine.zero_stage"),
        (["stage=finetune", "objective.kind=mae"], "does not fit stage"),
        (["objective.kind=beit", "objective.mask.min_patchs=4"], "objective.mask.min_patchs: unknown key (did you"),
        (["objective.kind=beit", "objective.mask.kind=random", "objective.mask.ratoi=0.5"], "'ratio'?"),
        (["objective.kind=beit", "objective.mask.num_masked=196"], "objective.mask masks 196 of 196 patches"),
        (["objective.kind=beit", "objective.mask.aspect_ratio=[2, 1]"], "objective.mask: Value error, aspect_ratio"),
        (["objective.kind=beit", "objective.target.kind=tokenizer"], "needs objective.target.path"),
        (["objective.kind=beit", "objective.target.kind=colour"], "objective.target.kind"),
        (["stage=tokenizer", "objective.codebook=5"], "objective.codebook: unknown key (did you mean 'codebook_size'"),
        (["stage=tokenizer", "objective.kind=mae"], "does not fit stage"),
        (["optim.layer_decay=1.5"], "optim.layer_decay"),
        (["engine.zero_stage=2", "engine.offload_param=cpu"], "engine.offload_param needs engine.zero_stage 3"),
        (["engine.zero_stage=0", "engine.offload_optimizer=cpu"], "engine.offload_optimizer needs engine.zero_stage"),
        (["engine.offload_optimizer=nvme"], "engine.offload_optimizer"),
        (["data.read_timeout_s=0"], "data.read_timeout_s"),
        (["data.read_retries=-1"], "data.read_retries"),
        (["data.max_skipped_shard_fraction=1.5"], "data.max_skipped_shard_fraction"),
        (["stage=finetune", "model.arch=resnet"], "model.arch resnet is the backbone of the FPN segmentation heads"),
        (["stage=finetune", "objective.kind=segmentation", "model.arch=resnet"], "upernet does not fit model.arch"),
        (["stage=finetune", "objective.kind=segmentation", "objective.head=vt_fpn"], "vt_fpn does not fit model.arch"),
        (SEG_FPN + ["engine.zero_stage=3"], "model.arch resnet needs engine.zero_stage 0-2"),
        (["stage=tokenizer", "model.init=x"], "the tokenizer stage trains a VQ-VAE from scratch"),
        (["augment.mixup=0.8"], "augment.mixup is set, but stage pretrain does not read it"),
        (["model.num_classes=10"], "model.num_classes is set, but stage pretrain does not read it"),
        (["eval.every_steps=5"], "eval.every_steps is set, but stage pretrain does not read it: pretraining evaluates"),
        (["stage=tokenizer", "objective.kind=vqvae", "model.size=large"], "model.size is set, but stage tokenizer"),
        (["stage=tokenizer", "objective.kind=vqvae", "eval.every_steps=5"], "eval.every_steps is set, but stage tok"),
        (["stage=tokenizer", "objective.kind=vqvae", "data.val=x"], "data.val is set, but stage tokenizer does not"),
        (["stage=tokenizer", "objective.kind=vqvae", "engine.attention=math"], "the VQ-VAE has no attention layers"),
        (["data.eval_batch_size_per_device=8"], "data.eval_batch_size_per_device is set, but stage pretrain"),
        (SEG + ["data.crop_scale=[0.5,1.0]"], "data.crop_scale is set, but stage finetune with objective segmentation"),
        (SEG + ["model.head_init=trunc_normal"], "model.head_init is set, but stage finetune with objective segm"),
        (SEG + ["data.label_field=y"], "segmentation reads masks, not class labels"),
        (SEG + ["augment.mix_prob=0.5"], "augment.mix_prob is set, but stage finetune with objective segmentation"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value)


def test_the_shard_read_keys_make_the_loaders_read_policy():
    assert load_config(None, []).data.read_policy() == ShardReadPolicy()  # one set of defaults
    overrides = [
        "data.read_timeout_s=2.5",
        "data.read_retries=0",
        "data.read_backoff_s=0",
        "data.max_skipped_shard_fraction=1",
    ]
    policy = load_config(None, overrides).data.read_policy()
    assert policy == ShardReadPolicy(timeout_s=2.5, retries=0, backoff_s=0.0, max_skipped_fraction=1.0)


def test_unknown_key_in_recipe_file_names_file_and_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {size: base, pach_size: 16}\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(recipe) in str(err.value) and "model.pach_size: unknown key (did you mean 'patch_size'?)" in str(
        err.value
    )


def test_precedence_defaults_recipe_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim: {base_lr: 1.0e-3, weight_decay: 0.1}\nschedule: {steps: 7}\n")
    cfg = load_config(recipe, ["optim.base_lr=2e-3", "model.img_size=[32, 48]", "model.patch_size=8"])
    assert cfg.optim.base_lr == 2e-3 and cfg.optim.weight_decay == 0.1  # override wins, recipe kept
    assert cfg.optim.betas == (0.9, 0.95)  # default
    assert cfg.model.grid == (4, 6)


def test_two_level_base_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("schedule: {steps: 1}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match="at most one parent"):
        load_config(tmp_path / "c.yaml")


def test_a_key_a_stage_ignores_passes_at_its_default_as_a_config_dump_holds_it():
    cfg = load_config(None, ["augment.mixup=0.0", "model.num_classes=null", "distill.kind=none"])
    assert cfg.stage == "pretrain" and cfg.augment.mixup == 0.0


def test_dump_round_trips(tmp_path):
    cfg = load_config(RECIPES[0].parent / "quickstart_finetune.yaml", ["optim.base_lr=3e-4"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    assert yaml.safe_load(path.read_text())["objective"]["kind"] == "classification"


def test_batch_split_and_lr_rules():
    cfg = load_config(None, ["data.global_batch_size=4096", "engine.grad_accum_steps=4", "optim.base_lr=1.5e-4"])
    assert cfg.batch_size_per_device(8) == 128
    with pytest.raises(ConfigError, match="world size 3"):
        cfg.batch_size_per_device(3)
    assert cfg.peak_lr == pytest.approx(2.4e-3)
    absolute = load_config(None, ["optim.lr_rule=absolute", "optim.base_lr=1.5e-3", "data.global_batch_size=2048"])
    assert absolute.peak_lr == 1.5e-3


def test_epochs_convert_once_to_steps():
    cfg = load_config(None, ["schedule={epochs: 2.5, warmup_epochs: 0.5}", "data.global_batch_size=100"])
    assert cfg.steps(1000) == (25, 5)
    with pytest.raises(ConfigError, match="samples_per_epoch"):
        cfg.steps(None)
    with pytest.raises(ConfigError, match="exactly one of schedule.steps and schedule.epochs"):
        load_config(None, ["schedule={steps: 3, epochs: 1}"])


def test_mask_kind_defaults_to_blockwise_and_budget():
    cfg = load_config(None, ["objective.kind=beit", "objective.mask.min_patches=4"])
    assert cfg.objective.mask.kind == "blockwise" and cfg.objective.mask.budget(196) == 78  # round(0.4 x 196)
    cfg = load_config(RECIPES[0].parent / "beit_vitb.yaml")
    assert cfg.objective.mask.budget(196) == 75 and cfg.peak_lr == 1.5e-3  # absolute lr, whatever the batch
    assert cfg.model.layer_scale_init == 0.1 and cfg.optim.grad_clip == 3.0


def test_a_section_whose_kind_changes_is_replaced_not_merged(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("objective: {kind: beit, mask: {kind: blockwise, num_masked: 20, min_patches: 4}}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nobjective: {mask: {kind: random, ratio: 0.3}}\n")
    assert load_config(child).objective.mask.model_dump() == {"kind": "random", "ratio": 0.3}
    child.write_text("base: base.yaml\nobjective: {mask: {min_patches: 2}}\n")  # same kind: merged
    assert load_config(child).objective.mask.num_masked == 20 and load_config(child).objective.mask.min_patches == 2
