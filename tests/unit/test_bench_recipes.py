"""recipes/bench/ (`make bench-quality`'s protocol): every recipe loads, on the same ViT and budget; the tokenizer codes
the ViT's 7x7 grid; fine-tuning is scored at its last step only; the teacher objectives train fewer steps."""

from pathlib import Path

import pytest

from core.recipe.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "recipes" / "bench"


@pytest.mark.parametrize("recipe", sorted(BENCH.glob("*.yaml")), ids=lambda p: p.name)
def test_bench_recipes_load_with_the_protocol(recipe):
    cfg = load_config(recipe)
    assert recipe.read_text().splitlines()[0].startswith("# ./launch.sh recipes/bench/")
    if cfg.stage == "tokenizer":
        assert (cfg.objective.img_size, cfg.objective.downsample) == (28, 4)  # the ViT's 7x7 grid
        return
    m = cfg.model
    assert (m.embed_dim, m.depth, m.num_heads, m.img_size, m.patch_size) == (192, 6, 3, 28, 4)
    if cfg.stage == "pretrain":
        # the EMA-teacher objectives cost more per step: fewer steps for about MAE's pretraining CPU time (their
        # recipes say so; benchmarks/time_to_accuracy.py measures it), the warmup a tenth of the run as MAE's
        fewer = {"data2vec2": (800, 80), "ijepa": (1500, 150)}
        steps = fewer.get(cfg.objective.kind, (1760, 176))
        assert (cfg.steps(None), cfg.data.global_batch_size, cfg.eval.knn.enabled) == (steps, 256, True)
        if cfg.objective.kind in fewer:
            assert cfg.objective.ema.steps == steps[0]  # the teacher's schedule spans the run
    else:
        expected = {"finetune_1pct": (300, 64), "finetune_10pct": (250, 128), "finetune_full": (400, 128)}
        assert (cfg.steps(None)[0], cfg.data.global_batch_size) == expected[recipe.stem]
        assert cfg.eval.every_steps == 0  # scored at the last step only, never chosen on the test set
