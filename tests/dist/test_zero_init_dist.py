"""ZeRO-3 construction under deepspeed.zero.Init (tests/dist/zero_init_worker.py under torchrun, 2 gloo ranks)."""

from __future__ import annotations

import json
import math

import pytest

from tests.launching import torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero_init")
    torchrun("zero_init_worker.py", out)
    return json.loads((out / "zero_init.json").read_text())


@pytest.mark.parametrize("kind", ["mae", "beit"])
def test_each_rank_holds_half_and_groups_match_the_plain_build(built, kind):
    result = built[kind]
    assert 0.45 < result["held_share"] < 0.55
    assert result["groups"] == result["plain_groups"]  # made from the meta-device twin's shapes
    assert any(wd == 0.0 and "encoder.blocks.0.attn.qkv.bias" in names for names, wd in result["groups"])


def test_mae_initialisation_reaches_partitioned_weights(built):
    """MAE's init runs after its sub-modules were partitioned: xavier Linear, sin-cos pos_embed, unit norms."""
    result = built["mae"]
    fan_out, fan_in = result["qkv_fan"]
    assert result["qkv_std"] == pytest.approx(math.sqrt(2 / (fan_in + fan_out)), rel=0.1)
    assert result["pos_is_sincos"] and result["biases_zero"] and result["norm_weights"] == [1.0]


def test_beit_initialisation_reaches_partitioned_weights(built):
    """timm's ViT init (trunc-normal 0.02) and the head's init, redone on gathered weights."""
    result = built["beit"]
    assert result["qkv_std"] == pytest.approx(0.02, rel=0.1)  # torch's default would be ~0.10 at fan-in 32
    assert result["head_std"] == pytest.approx(0.02, rel=0.15)
    assert result["biases_zero"] and result["norm_weights"] == [1.0]
    assert not result["pos_is_sincos"]


def test_fp32_master_weights_are_the_parameter_partitions(built):
    """fp32 partitions need no master copy (core/compat/deepspeed.py `fp32_master_shared`): 4 bytes per parameter."""
    assert built["master_is_partition"] and all(built["master_is_partition"])


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_step_the_parameter_partitions_and_train_like_zero0(built, stage):
    """ZeRO-1/2 keep no fp32 master copy either (core/compat/deepspeed.py `share_zero12_masters`): each rank's master
    partition is its slice of the flat parameter buffer, and 3 clipped SGD steps on 2 ranks end where ZeRO-0's do."""
    result = built[f"zero{stage}"]
    assert result["master_is_partition"] and all(result["master_is_partition"])
    assert result["max_diff"] < 1e-6 * built["clip_0.01"]["updates"][1]


def test_zero3_trains_like_zero0_with_and_without_clipping(built):
    """3 fp32 steps on 2 ranks from the same weights: ZeRO-3's trimmed step (per-block gathering, Linear32, no norm or
    unscale without clipping) moves every parameter as ZeRO-0 does, and with clipping it still clips."""
    free, clipped = built["clip_0.0"], built["clip_0.01"]
    for run in (free, clipped):
        assert run["updates"][0] > 0  # every parameter moved
        assert run["max_relative_diff"] < 1e-4  # per parameter: |ZeRO-3 - ZeRO-0| / |update|, both at their largest
    assert clipped["updates"][1] < free["updates"][1] / 5
