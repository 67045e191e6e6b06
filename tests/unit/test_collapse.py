"""The label-free monitor's numbers on features whose answer is known: RankMe's effective rank of an orthonormal set
is its size and of a rank-one set 1; the normalised features' spread is 0 when collapsed and 1 x sqrt(D) / sqrt(D)
for an even spread on the axes; the monitors' joint cadence."""

from __future__ import annotations

import math

import pytest
import torch

from core.recipe.config import load_config
from core.report.collapse import effective_rank, normalised_std
from pretrain.feature_monitor import features_are_knn_bank


def test_effective_rank_of_an_orthonormal_set_is_its_size_and_of_one_direction_one():
    assert effective_rank(torch.eye(6)) == pytest.approx(6.0, rel=1e-5)
    one_direction = torch.randn(50, 1) * torch.randn(1, 8)  # every row a multiple of one vector
    assert effective_rank(one_direction) == pytest.approx(1.0, abs=1e-4)
    two = torch.cat([torch.eye(2), torch.zeros(2, 6)], dim=1).repeat(10, 1)  # two directions, equally used
    assert effective_rank(two) == pytest.approx(2.0, rel=1e-5)


def test_normalised_std_is_zero_when_collapsed_and_near_one_when_spread():
    assert normalised_std(torch.ones(40, 16) * 3.0) == pytest.approx(0.0, abs=1e-12)
    axes = torch.cat([torch.eye(16), -torch.eye(16)])  # +-e_i: per dimension std sqrt(2/32) = 1/4 = 1/sqrt(16)
    assert normalised_std(axes) == pytest.approx(1.0)
    torch.manual_seed(0)
    assert normalised_std(torch.randn(4000, 64)) == pytest.approx(1.0, abs=0.02)
    assert math.isfinite(normalised_std(torch.randn(3, 5)))


def test_the_loop_evaluates_often_enough_for_each_monitor():
    both = ["eval.knn.enabled=true", "eval.knn.every_steps=150", "eval.features.enabled=true",
            "eval.features.every_steps=100", "data.val=x", "data.train=y"]  # fmt: skip
    assert load_config(None, both).eval_every_steps == 50
    assert load_config(None, ["eval.features.enabled=true", "eval.features.every_steps=70"]).eval_every_steps == 70
    with pytest.raises(ValueError, match="eval.features needs stage pretrain"):
        load_config(None, ["stage=finetune", "eval.features.enabled=true"])


def test_the_label_free_monitor_reuses_the_knn_bank_only_when_it_watches_the_same_images(tmp_path):
    """Same shards (unset on both: the training shards; or the same files named two ways), max_samples and pooling."""
    shards = [tmp_path / f"train-{i:06d}.tar" for i in range(2)]
    for shard in shards:
        shard.touch()
    on = ["eval.knn.enabled=true", "data.val=x", "data.train=y", "eval.features.enabled=true"]
    same = [*on, "eval.knn.bank.max_samples=2048"]  # the label-free monitor's default count
    assert features_are_knn_bank(load_config(None, same))
    assert not features_are_knn_bank(load_config(None, on))  # 10,000 bank images against 2,048
    assert not features_are_knn_bank(load_config(None, [*same, "eval.features.pooling=mean"]))
    named = [f"eval.knn.bank.shards={tmp_path}/train-*.tar", f"eval.features.shards=[{shards[0]},{shards[1]}]"]
    assert features_are_knn_bank(load_config(None, [*same, *named]))
    assert not features_are_knn_bank(load_config(None, [*same, *named[:1], f"eval.features.shards={shards[0]}"]))
    mixture = [f"data.train=[{{shards: {shards[0]}}}, {{shards: {shards[1]}}}]", f"eval.knn.bank.shards={shards[0]}"]
    assert features_are_knn_bank(load_config(None, [*same, *mixture]))  # unset: the mixture's first source
