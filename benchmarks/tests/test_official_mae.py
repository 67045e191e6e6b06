"""bench_engine's official-MAE row: the timm 0.3.2 / torch 1.x shims, the ceiling arithmetic and the side-by-side
table. The official checkout itself is not in this tree; a stand-in with its import lines checks the loading."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import Block
from torch import nn

from benchmarks.bench_engine import Case, build_cases, parse_args
from benchmarks.ceiling import LinearShape, encoder_mlp_shape, time_autocast_linear, utilisation
from benchmarks.official_mae import OFFICIAL_FILES, RepeatedBatch, Timm032Block, install_import_shims, load_official
from benchmarks.profile_step import kind_of
from benchmarks.side_by_side import (
    goal_lines,
    mallocs,
    reference_lines,
    render_side_by_side,
    section,
    summarize_ceiling,
)

# The lines of the official code that fail against timm 1.0, NumPy 2 and torch 2 without the shims.
STAND_IN = {
    "models_mae.py": (
        "import torch.nn as nn\n"
        "from timm.models.vision_transformer import PatchEmbed, Block\n"
        "from util.pos_embed import width\n"
        "def build():\n"
        "    return Block(width(), 2, 4., qkv_bias=True, qk_scale=None, norm_layer=nn.LayerNorm)\n"
    ),
    "engine_pretrain.py": "import util.misc as misc\nimport util.lr_sched as lr_sched\n",
    "util/misc.py": "from torch._six import inf\nINF = inf\n",
    "util/lr_sched.py": "import math\n",
    "util/pos_embed.py": "import numpy as np\ndef width():\n    return int(np.arange(8, dtype=np.float)[-1]) + 1\n",
}


@pytest.fixture
def clean_imports():
    """Restores sys.modules and NumPy's namespace after a test that imports a checkout."""
    before = set(sys.modules)
    had_float = "float" in np.__dict__
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]
    if not had_float and "float" in np.__dict__:
        del np.float


def test_timm032_block_matches_timm_block_with_explicit_attention():
    torch.manual_seed(0)
    old = Timm032Block(32, 4, 4.0, qkv_bias=True, qk_scale=None, norm_layer=nn.LayerNorm).eval()
    new = Block(32, 4, 4.0, qkv_bias=True, norm_layer=nn.LayerNorm).eval()
    assert [name for name, _ in old.named_parameters()] == [name for name, _ in new.named_parameters()]
    new.load_state_dict(old.state_dict())
    x = torch.randn(2, 5, 32)  # (B, N, D)
    assert not old.attn.fused_attn  # timm 0.3.2's q @ k^T, softmax, @ v
    torch.testing.assert_close(old(x), new(x), rtol=1e-5, atol=1e-5)
    sdpa = Timm032Block(32, 4, 4.0, qkv_bias=True, qk_scale=None, norm_layer=nn.LayerNorm, fused_attn=True).eval()
    sdpa.load_state_dict(old.state_dict())
    assert sdpa.attn.fused_attn  # the official-sdpa runner: timm 1.0's F.scaled_dot_product_attention
    torch.testing.assert_close(sdpa(x), old(x), rtol=1e-5, atol=1e-5)


def test_timm032_block_takes_qk_scale():
    block = Timm032Block(32, 4, qk_scale=0.5)
    assert block.attn.scale == 0.5
    assert Timm032Block(32, 4).attn.scale == pytest.approx(8**-0.5)


def test_import_shims_restore_removed_names(clean_imports):
    missing = ("float" not in vars(np)) + (importlib.util.find_spec("torch._six") is None)
    applied = install_import_shims()
    assert np.float is float
    from torch._six import inf

    assert inf == math.inf
    assert len(applied) == missing  # NumPy 2 and torch 2: both
    assert install_import_shims() == []  # nothing left to shim


@pytest.mark.parametrize("sdpa", [False, True])
def test_load_official_imports_a_checkout_through_the_shims(tmp_path: Path, clean_imports, sdpa: bool):
    for name, text in STAND_IN.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    path_before = list(sys.path)
    official = load_official(tmp_path, sdpa=sdpa)
    assert sys.path == path_before  # the checkout is imported from where it is, not put on the import path
    block = official.models_mae.build()  # timm 1.0's Block would reject qk_scale
    assert isinstance(block, Timm032Block) and block.attn.num_heads == 2 and block.mlp.fc1.in_features == 8
    assert block.attn.fused_attn is sdpa
    assert math.isinf(official.misc.INF) and official.misc.INF > 0
    assert official.engine_pretrain.misc is official.misc


def test_load_official_names_missing_files(tmp_path: Path):
    (tmp_path / "models_mae.py").write_text("")
    with pytest.raises(FileNotFoundError, match="engine_pretrain.py") as err:
        load_official(tmp_path)
    assert "models_mae.py" not in str(err.value).split("missing")[1]
    assert len(OFFICIAL_FILES) == 5


def test_repeated_batch_marks_every_draw_and_the_end():
    images, marks = torch.zeros(2, 3, 4, 4), []
    loader = RepeatedBatch(images, 3, lambda: marks.append(len(marks)))
    drawn = list(loader)
    assert len(loader) == 3 and len(drawn) == 3 and len(marks) == 4
    assert all(x is images and y is None for x, y in drawn)


def test_linear_flops_and_encoder_shape():
    shape = LinearShape(rows=10, d_in=3, d_out=4)
    assert shape.flops(backward=False) == 2 * 10 * 3 * 4
    assert shape.flops() == 3 * 2 * 10 * 3 * 4
    # ViT-B/16 at 224 px: 196 patches, int(196 * 0.25) = 49 visible, plus the class token, per image
    assert encoder_mlp_shape("base", 32, 224) == LinearShape(rows=32 * 50, d_in=768, d_out=3072)


def test_utilisation_arithmetic():
    assert utilisation(2e12, 4.0, 0.5) == pytest.approx(1.0)
    assert utilisation(1e12, 5.0, 0.4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        utilisation(1e12, 0.0, 0.4)


def test_time_autocast_linear_gives_one_value_per_trial():
    marks = []
    clock = type("Clock", (), {"mark": lambda self: marks.append(1)})()
    tflops = time_autocast_linear(LinearShape(16, 8, 32), trials=3, clock=clock)
    assert len(tflops) == 3 and all(v > 0 for v in tflops) and len(marks) == 4


def _summary(median: float, cpu: float) -> dict:
    return {"median": median, "min": median * 0.9, "rounds": [median], "others_load": 0.1, "backward": 1.0, "cpu": cpu}


def test_side_by_side_table_and_goals():
    shape = vars(LinearShape(1000, 100, 200))  # 3 * 2 * 1000 * 100 * 200 = 1.2e8 FLOPs per trial
    ceiling = summarize_ceiling(
        [
            {
                "tflops": [0.3, 0.5],
                "cpu": [1.2e-4 / 0.5, 1.2e-4 / 0.7],
                "matmul_tflops": 0.6,
                "others_load": 0.1,
                "shape": shape,
            },
            {"tflops": [0.4], "cpu": [1.2e-4 / 0.5], "matmul_tflops": 0.4, "others_load": 0.3, "shape": shape},
        ]
    )
    assert (ceiling["median"], ceiling["max"], ceiling["matmul"], ceiling["others_load"]) == (0.4, 0.5, 0.5, 0.3)
    assert ceiling["rounds"] == [0.4, 0.4] and ceiling["cpu"] == pytest.approx(0.5)
    base = {"step_phase": 0.1, "optimizer": 0.05, "flops": 4e12}
    official = {**_summary(15.0, 16.0), **base}
    ours = {"plain torch loop": {**_summary(10.0, 10.0), **base}, "engine ZeRO-2": {**_summary(10.2, 8.0), **base}}
    rows = render_side_by_side([("official MAE code", official), *ours.items()], official, ceiling)
    zero2 = next(line for line in rows if line.startswith("| engine ZeRO-2"))
    cells = [cell.strip() for cell in zero2.split("|")[1:-1]]
    assert cells[8:11] == ["1.47 / 1.47", "8.000", "2.00"]  # official / ZeRO-2 by wall-clock; CPU s; by CPU
    # 4e12 FLOPs in 10.2 s wall (0.392 TFLOP/s) and 8 s CPU (0.5) against ceilings of 0.4 (wall) and 0.5 (CPU)
    assert cells[11:] == ["4000", "0.392 / 0.500", "98% / 100%"]
    assert goal_lines(ours, official, ceiling) == [
        "- ZeRO-2 step vs the official code: 1.47x / 2.00x by wall-clock / CPU time (goal >= 1.5x: not met / met)",
        "- ZeRO-2 of the ceiling: 98% / 100% by wall-clock / CPU time (goal >= 85%: met / met)",
        "- ZeRO-2 over the plain loop: +2.0% / -20.0% by wall-clock / CPU time (goal <= 3%: met / met)",
    ]
    ours["engine ZeRO-2 compiled"] = {**_summary(8.0, 8.0), **base}
    lines = goal_lines(ours, official, ceiling)
    assert lines[2:4] == [
        "- ZeRO-2 compiled step vs the official code: 1.88x / 2.00x by wall-clock / CPU time (goal >= 1.5x: met / met)",
        "- ZeRO-2 compiled of the ceiling: 125% / 100% by wall-clock / CPU time (goal >= 85%: met / met)",
    ]
    assert len(lines) == 5 and "compiled over" not in lines[4]  # the overhead goal is read on eager stages only
    sdpa = {"official MAE code, timm 1.0 SDPA attention": _summary(20.4, 24.0)}
    assert reference_lines(ours, sdpa) == [
        "- ZeRO-2 step vs the official MAE code, timm 1.0 SDPA attention: 2.00x / 3.00x by wall-clock / CPU time",
        "- ZeRO-2 compiled step vs the official MAE code, timm 1.0 SDPA attention: 2.55x / 3.00x by wall-clock / "
        "CPU time",
    ]


def test_build_cases_adds_the_official_code_and_the_ceiling():
    args = parse_args(["--allocators", "glibc", "--stages", "2", "--official-mae", "/somewhere/mae"])
    main, _, side = build_cases(args)
    assert main == [Case(None, "fused", "glibc"), Case(2, "fused", "glibc")]
    assert side == [
        Case(None, "forloop", "glibc", kind="official"),
        Case(None, "forloop", "glibc", kind="official-sdpa"),
        Case(None, "-", "glibc", kind="ceiling"),
    ]
    assert [case.runner for case in side] == [
        "official MAE code",
        "official MAE code, timm 1.0 SDPA attention",
        "autocast-Linear ceiling",
    ]
    assert build_cases(parse_args(["--allocators", "glibc"]))[2] == []
    args = parse_args(["--allocators", "glibc-keep", "--official-mae", "/mae", "--official-allocator", "glibc"])
    assert [case.allocator for case in build_cases(args)[2]] == ["glibc", "glibc", "glibc-keep"]  # the ceiling: ours
    assert mallocs("tcmalloc", "glibc") == "ours under tcmalloc, the official code under glibc"
    assert mallocs("tcmalloc", "tcmalloc") == "tcmalloc"


def test_build_cases_runs_compiled_stages_again():
    main, _, _ = build_cases(parse_args(["--allocators", "glibc", "--stages", "0,2", "--compile-stages", "2"]))
    assert main == [
        Case(None, "fused", "glibc"),
        Case(0, "fused", "glibc"),
        Case(2, "fused", "glibc"),
        Case(2, "fused", "glibc", compiled=True),
    ]
    assert main[-1].runner == "engine ZeRO-2 compiled"


def test_profile_kinds():
    assert kind_of("aten::addmm") == "matmul"
    assert kind_of("aten::copy_") == "copies and casts"
    assert kind_of("aten::_fused_adamw_") == "optimizer"
    assert kind_of("aten::native_layer_norm_backward") == "layer norm"
    assert kind_of("aten::argsort") == "other"


def test_run_all_reports_every_round_in_interleaved_order(monkeypatch):
    import benchmarks.bench_engine as bench

    order, written = [], []

    def fake_run_case(case, args, scratch, count_flops=False):
        order.append((case.zero_stage, count_flops))
        return {"step": [1.0], "others_load": 0.0}

    monkeypatch.setattr(bench, "run_case", fake_run_case)
    args = parse_args(["--rounds", "2", "--allocators", "glibc", "--stages", "2"])
    cases = [Case(None, "fused", "glibc"), Case(2, "fused", "glibc")]
    results = bench.run_all(cases, args, after_round=lambda res, done: written.append((done, len(res[cases[0]]))))
    assert order == [(None, True), (2, True), (2, False), (None, False)]  # reversed on odd rounds; FLOPs in round 1
    assert written == [(1, 1), (2, 2)] and all(len(runs) == 2 for runs in results.values())


def test_section_compares_ours_under_our_malloc_with_the_official_code_under_its_own():
    shape = vars(LinearShape(1000, 100, 200))
    ceiling_run = {"tflops": [0.4], "cpu": [1.2e-4 / 0.5], "matmul_tflops": 0.5, "others_load": 0.0, "shape": shape}
    official = Case(None, "forloop", "glibc", kind="official")
    sdpa = Case(None, "forloop", "glibc", kind="official-sdpa")
    ceiling = Case(None, "-", "tcmalloc", kind="ceiling")
    plain, zero2 = Case(None, "fused", "tcmalloc"), Case(2, "fused", "tcmalloc")
    compiled, glibc_zero2 = Case(2, "fused", "tcmalloc", compiled=True), Case(2, "fused", "glibc")
    seconds = {official: 12.0, sdpa: 15.0, plain: 9.0, zero2: 10.0, compiled: 8.0, glibc_zero2: 30.0}
    stats = {case: {**_summary(s, s), "step_phase": 0.1, "optimizer": 0.05} for case, s in seconds.items()}
    results = {case: [{"flops": 4e12 if case in (official, sdpa, plain) else None}] for case in seconds}
    results[ceiling] = [ceiling_run]
    lines = section([plain, zero2, compiled, glibc_zero2], [official, sdpa, ceiling], stats, results)
    assert lines[0] == "## Side by side with the official MAE code (ours under tcmalloc, the official code under glibc)"
    runners = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert runners == [
        "official MAE code",
        "official MAE code, timm 1.0 SDPA attention",
        "plain torch loop",
        "engine ZeRO-2",
        "engine ZeRO-2 compiled",
    ]  # ZeRO-2 under glibc is not ours here: only the ceiling's malloc is compared
    assert "- ZeRO-2 step vs the official code: 1.20x / 1.20x by wall-clock / CPU time" in "\n".join(lines)
    assert "- ZeRO-2 compiled step vs the official MAE code, timm 1.0 SDPA attention: 1.88x / 1.88x" in "\n".join(lines)
