"""The kNN monitor's parts in one process: DINO's weighted vote on hand-computed values, pooling, embedding, the
per-shard sample quotas of its sets, leaving training untouched, and the `eval.knn` config checks."""

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image

import pretrain.knn as knn_module
from core.engine.distributed import DistInfo
from core.models.vit import build_vit
from core.recipe.config import ConfigError, load_config
from data.pipeline import make_eval_loader
from data.specs import sample_quotas
from data.write import write_shards
from pretrain.knn import KNNBank, embed, pooled_features, training_untouched

DIST = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))

# Four unit vectors in 2-D with classes 0, 1, 1, 2.
BANK = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]])
BANK_LABELS = torch.tensor([0, 1, 1, 2])


def test_weighted_votes_match_hand_computed_values():
    queries = torch.tensor([[1.0, 0.0], [-0.6, 0.8]])
    votes = KNNBank(BANK, BANK_LABELS, k=3, temperature=0.5, num_classes=3).votes(queries)
    # Query 0: similarities 1, 0, -1, 0.6 -> neighbours 0 (class 0), 3 (class 2), 1 (class 1).
    # Query 1: similarities -0.6, 0.8, 0.6, 0.28 -> neighbours 1 and 2 (class 1, their votes add up), 3 (class 2).
    expected = torch.tensor(
        [
            [math.exp(1 / 0.5), math.exp(0 / 0.5), math.exp(0.6 / 0.5)],
            [0.0, math.exp(0.8 / 0.5) + math.exp(0.6 / 0.5), math.exp(0.28 / 0.5)],
        ]
    )
    assert torch.allclose(votes, expected, rtol=1e-5)


def test_k_larger_than_the_bank_uses_every_sample():
    votes = KNNBank(BANK, BANK_LABELS, k=20, temperature=1.0, num_classes=3).votes(BANK[:1])
    expected = torch.tensor([[math.e, math.exp(0) + math.exp(-1), math.exp(0.6)]])
    assert torch.allclose(votes, expected, rtol=1e-5)


def test_correct_counts_top1_and_top5():
    queries = torch.tensor([[1.0, 0.0], [-0.6, 0.8], [0.6, 0.8]])
    # With k=1 each query takes its nearest neighbour's class: 0, 1, 2.
    correct = KNNBank(BANK, BANK_LABELS, k=1, temperature=0.07, num_classes=3).correct(queries, torch.tensor([0, 2, 2]))
    assert correct.tolist() == [2, 3]  # top-5 of 3 classes holds every class


def tiny_vit():
    torch.manual_seed(0)
    return build_vit("tiny", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2).eval()


def test_cls_and_mean_pooling():
    vit, images = tiny_vit(), torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        tokens = vit.forward_features(images)  # (3, 1 + 16, 32)
        cls, mean = pooled_features(vit, images, "cls"), pooled_features(vit, images, "mean")
    assert tokens.shape == (3, 17, 32) and cls.shape == mean.shape == (3, 32)
    assert torch.equal(cls, tokens[:, 0])
    assert torch.allclose(mean, tokens[:, 1:].mean(dim=1))
    assert not torch.allclose(cls, mean)
    with pytest.raises(ValueError, match="pooling must be 'cls' or 'mean'"):
        pooled_features(vit, images, "max")


def test_embed_gives_unit_features_with_their_labels():
    vit = tiny_vit()
    batches = [{"image": torch.randn(4, 3, 16, 16), "label": torch.tensor([0, 1, 2, 3])}] * 2
    batches[1] = {"image": torch.randn(2, 3, 16, 16), "label": torch.tensor([5, 6])}
    features, labels = embed(vit, batches, dist=DIST, precision="bf16", pooling="mean", image_shape=(3, 16, 16))
    assert features.shape == (6, 32) and features.dtype == torch.float32
    assert torch.allclose(features.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert labels.tolist() == [0, 1, 2, 3, 5, 6]
    with torch.no_grad():
        first = torch.nn.functional.normalize(pooled_features(vit, batches[0]["image"], "mean"), dim=-1)
    assert torch.allclose(features[:4], first, atol=0.05)  # bf16 autocast against fp32
    empty = embed(vit, [], dist=DIST, precision="fp32", pooling="cls", image_shape=(3, 16, 16))
    assert empty[0].shape == (0, 32) and empty[1].shape == (0,)


def test_rank_that_runs_out_forwards_zero_stand_ins(monkeypatch):
    """A peer still has batches for two more rounds: this rank forwards two zero batches and keeps nothing."""
    rounds = iter([1.0, 1.0, 1.0, 0.0])

    def peer_has_data(tensor, op="sum"):
        tensor[0] = max(float(tensor[0]), next(rounds))
        return tensor

    monkeypatch.setattr(knn_module, "all_reduce", peer_has_data)
    vit, seen = tiny_vit(), []
    vit.patch_embed.register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    batch = {"image": torch.randn(2, 3, 16, 16), "label": torch.tensor([1, 2])}
    features, labels = embed(vit, [batch], dist=DIST, precision="fp32", pooling="cls", image_shape=(3, 16, 16))
    assert len(seen) == 3 and seen[1].shape == (1, 3, 16, 16) and not seen[1].any() and not seen[2].any()
    assert features.shape == (2, 32) and labels.tolist() == [1, 2]


def test_training_untouched_restores_mode_and_every_rng():
    vit = tiny_vit().train()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = torch.rand(2), random.random(), np.random.rand()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with training_untouched(vit, torch.device("cpu")):
        assert not vit.training and not vit.blocks[0].training
        torch.rand(5), random.random(), np.random.rand(3)
    assert vit.training and vit.blocks[0].training
    after = torch.rand(2), random.random(), np.random.rand()
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def write_sized_shards(out, sizes: list[int]) -> list[str]:
    """Shards of the given sizes (16 px grey images, label = sample number % 3), with an index.json."""
    paths = []
    for number, size in enumerate(sizes):
        first = sum(sizes[:number])
        samples = [(f"s{first + i:05d}", Image.new("L", (16, 16), first + i), (first + i) % 3, {}) for i in range(size)]
        write_shards(samples, str(out / f"part{number}"), shard_size=size, split="val", classes=["a", "b", "c"],
                     source="test")  # fmt: skip
        paths.append(str(out / f"part{number}" / "val-000000.tar"))
    return paths


def test_quotas_follow_shard_sizes(tmp_path):
    shards = write_sized_shards(tmp_path, [6, 6, 3])
    assert sample_quotas(shards, 5) == [2, 2, 1]
    assert sample_quotas(shards, 4) == [2, 1, 1]  # exact shares 1.6, 1.6, 0.8: the largest remainders round up
    assert sample_quotas(shards, 100) == [6, 6, 3]
    assert sample_quotas(["a.tar", "b.tar", "c.tar"], 7) == [3, 2, 2]  # no index: equal shares
    with pytest.raises(ValueError, match="max_samples must be >= 1"):
        sample_quotas(shards, 0)


def test_limited_eval_pass_is_the_same_set_for_any_world_size(tmp_path):
    shards = write_sized_shards(tmp_path, [6, 6, 3, 5])

    def keys(rank: int, world_size: int) -> list[str]:
        loader = make_eval_loader(
            shards, transform=lambda image: torch.zeros(1), batch_size=4, rank=rank, world_size=world_size,
            num_workers=0, max_samples=9,
        )  # fmt: skip
        return [key for batch in loader for key in batch["key"]]

    one = keys(0, 1)
    rank0, rank1 = keys(0, 2), keys(1, 2)
    assert len(one) == 9 and not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(one)
    assert one == ["s00000", "s00001", "s00002", "s00006", "s00007", "s00008", "s00012", "s00015", "s00016"]


def pretrain_overrides(**knn) -> list[str]:
    return ["data.train=shards/train", "eval.knn.enabled=true"] + [f"eval.knn.{k}={v}" for k, v in knn.items()]


def test_config_defaults_and_values():
    cfg = load_config(None, [*pretrain_overrides(), "data.val=shards/val", "eval.knn.bank.shards=shards/bank"])
    knn = cfg.eval.knn
    assert (knn.k, knn.temperature, knn.pooling, knn.every_steps) == (20, 0.07, "cls", 1000)
    assert knn.bank.max_samples == 10000 and knn.query.max_samples is None  # giving shards keeps the bank's limit
    assert cfg.eval_every_steps == 1000
    with pytest.raises(ValueError, match="eval.every_steps is set, but stage pretrain does not read it"):
        load_config(None, ["eval.every_steps=7"])  # pretraining's cadence is the monitors'
    finetune = load_config(None, ["stage=finetune", "eval.every_steps=7"])
    assert finetune.eval_every_steps == 7 and not finetune.eval.knn.enabled


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (pretrain_overrides(), "eval.knn.query.shards is not set and neither is data.val"),
        (["stage=finetune", *pretrain_overrides(**{"query.shards": "v"})], "eval.knn needs stage pretrain"),
        (
            ["data.train=[{shards: a, weight: 1}]", "eval.knn.enabled=true", "data.val=v"],
            "eval.knn.bank.shards must be set when data.train is a mixture",
        ),
        (
            pretrain_overrides(**{"query.shards": "v", "bank.max_samples": 10}),
            "eval.knn.k 20 is larger than eval.knn.bank.max_samples 10",
        ),
        (pretrain_overrides(pooling="max"), "eval.knn.pooling: Input should be 'cls' or 'mean'"),
        (pretrain_overrides(temperature=0), "eval.knn.temperature: Input should be greater than 0"),
        (pretrain_overrides(**{"bank.max_sample": 5}), "eval.knn.bank.max_sample: unknown key (did you mean"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def test_preflight_checks_the_knn_sets_for_images_and_labels(capsys, tmp_path):
    """The bank defaults to data.train, which pretraining reads without labels: the monitor needs them."""
    from core.entry.launch_check import main as launch_check
    from tests.launching import copy_shards, write_synthetic

    train = write_synthetic(tmp_path / "train", "train", 32, 16, seed=0)
    unlabelled = copy_shards(train, tmp_path / "nocls", drop="cls")
    recipe = tmp_path / "pretrain.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\ndata: {{train: {unlabelled}}}\nschedule: {{steps: 2}}\n")
    knn = ["eval.knn.enabled=true", f"eval.knn.query.shards={train}"]
    code = launch_check([str(recipe), *knn, "--nproc-per-node", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "launch.sh: eval.knn.bank.shards (data.train): " in err and "no .cls" in err, err
    code = launch_check([str(recipe), *knn, f"eval.knn.bank.shards={train}", "--nproc-per-node", "1"])
    printed = "".join(capsys.readouterr())
    assert code == 0 and "eval.knn.query.shards: first sample of train-000000.tar has .png and a label" in printed


def test_monitor_in_one_process(capsys, tmp_path):
    """The whole `evaluate(step)` on a tiny random MAE encoder: synthetic classes are told apart by colour alone."""
    from types import SimpleNamespace

    from core.report.logging import MetricsLogger
    from pretrain.knn import knn_monitor
    from pretrain.mae import MAE
    from tests.launching import write_synthetic

    train = write_synthetic(tmp_path / "train", "train", 64, 16, seed=0)
    val = write_synthetic(tmp_path / "val", "val", 30, 10, seed=1)
    overrides = [f"data.train={train}", "data.num_workers=0", "model.size=tiny", "model.embed_dim=32"]
    overrides += ["model.depth=2", "model.num_heads=2", "model.img_size=16", "model.patch_size=4"]
    overrides += ["eval.knn.enabled=true", "eval.knn.bank.max_samples=40", f"eval.knn.query.shards={val}"]
    cfg = load_config(None, overrides)
    objective = MAE(tiny_vit().train(), decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    run = SimpleNamespace(cfg=cfg, dist=DIST, logger=MetricsLogger(tmp_path, enabled=True, tensorboard=False))
    evaluate = knn_monitor(run, SimpleNamespace(module=objective))
    metrics = evaluate(7)
    assert sorted(metrics) == ["knn/bank_samples", "knn/query_samples", "knn/seconds", "knn/top1", "knn/top5"]
    assert metrics["knn/bank_samples"] == 40 and metrics["knn/query_samples"] == 30
    assert 0.5 < metrics["knn/top1"] <= metrics["knn/top5"] == 1.0  # 4 classes: chance 0.25, top-5 holds all
    assert f"[mimpipe] step 7 knn: top1 {metrics['knn/top1']:.4f}" in capsys.readouterr().out
    assert objective.training and objective.encoder.blocks[0].training
    assert evaluate(8)["knn/top1"] == metrics["knn/top1"]  # the loaders start a fresh pass at every call
    assert knn_monitor(SimpleNamespace(cfg=load_config(None, []), dist=DIST), None) is None

    run.dist = DistInfo(rank=0, local_rank=0, world_size=4, device=torch.device("cpu"))  # val has 3 shards
    with pytest.raises(ValueError, match=r"eval.knn.query.shards: shard spec .*: 3 shards for 4 ranks"):
        knn_monitor(run, SimpleNamespace(module=objective))
