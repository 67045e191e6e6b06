"""benchmarks/bench_gpu.py's CPU-side logic: the search for the largest batch that fits, driven by a fake runner
with a known memory limit; the table rows it writes; the skip without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_gpu
from benchmarks.bench_gpu import Search, config_row, data_row, largest_batch, summarize


def fake_runner(capacity: int):
    """A measure() that fits batches up to `capacity` and records every batch it was asked for."""
    asked = []

    def measure(batch: int) -> dict | None:
        asked.append(batch)
        return {"batch": batch} if batch <= capacity else None

    return measure, asked


@pytest.mark.parametrize(
    ("capacity", "start", "found", "asked"),
    [
        (100, 8, 96, [8, 16, 32, 64, 128, 96, 112, 104]),  # doubles, then bisects in steps of 8
        (100, 256, 96, [256, 128, 64, 96, 112, 104]),  # halves while too big, then bisects
        (5000, 64, 4096, [64, 128, 256, 512, 1024, 2048, 4096]),  # every batch up to the limit fits
        (5, 64, 5, [64, 32, 16, 8, 4, 6, 5]),  # below the granularity: any size
    ],
)
def test_largest_batch_doubles_then_bisects(capacity, start, found, asked):
    measure, seen = fake_runner(capacity)
    search = largest_batch(measure, start=start, limit=4096, granularity=8)
    assert search.batch == found and search.result == {"batch": found}
    assert seen == asked
    assert search.tried == {batch: batch <= capacity for batch in asked}
    assert search.first_too_big == min((b for b in asked if b > capacity), default=None)


def test_nothing_fits():
    measure, seen = fake_runner(0)
    search = largest_batch(measure, start=4, limit=4096, granularity=8)
    assert search.batch is None and search.result is None and seen == [4, 2, 1]


RESULT = {  # 3 timed steps of 0.4, 0.5 and 0.6 s on the GPU's clock
    "step_ms": [500.0, 400.0, 600.0],
    "losses": [1.0, 0.9, 0.8],
    "peak_allocated_gib": 61.04,
    "peak_reserved_gib": 70.5,
    "compile_seconds": 0.0,
    "flops_per_step": 2.5e14,
    "peak_flops": 989e12,
}


def test_summary_and_row_of_a_measured_configuration():
    s = summarize(256, RESULT)
    assert s["images_per_sec"] == pytest.approx(512.0)
    assert s["mfu"] == pytest.approx(2.5e14 / 0.5 / 989e12)
    assert (s["step_ms"], s["min_ms"], s["max_ms"]) == (500.0, 400.0, 600.0)
    search = Search(tried={128: True, 256: True, 512: False, 384: False}, batch=256, result=RESULT)
    assert config_row("ViT-L/16", "bf16 eager", search) == (
        "| ViT-L/16 | bf16 eager | 256 | 512.0 | 50.6% | 61.0 / 70.5 | 500.0 (400.0-600.0) | out of memory at 384 |"
    )


def test_rows_without_mfu_without_a_fit_and_of_the_data_run():
    unknown_peak = {**RESULT, "peak_flops": None}
    row = config_row("ViT-B/16", "fp32 eager (control)", Search(tried={64: True}, batch=64, result=unknown_peak))
    assert "| 64 | 128.0 | - |" in row and row.endswith("| fits at every batch tried |")
    none = config_row("ViT-L/16", "fp32 eager (control)", Search(tried={8: False, 4: False, 2: False, 1: False}))
    assert none == "| ViT-L/16 | fp32 eager (control) | none fits | - | - | - | - | out of memory at 1 |"
    measured = {"wait": 0.031, "ips": 2150.0, "mfu": 0.41}
    assert data_row("ViT-B/16", "bf16 compiled", 384, 10, measured) == (
        "| ViT-B/16 | bf16 compiled | 384 | 10 | 3.1% | 2150.0 | 41.0% |"
    )
    failed = data_row("ViT-B/16", "bf16 eager", 384, 10, {"error": "exit code 1: boom"})
    assert failed == "| ViT-B/16 | bf16 eager | 384 | 10 | failed: exit code 1: boom | - | - |"


def test_without_a_gpu_it_says_why_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "gpu.md"
    assert bench_gpu.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("bench_gpu: skipped, no CUDA device visible to torch") and "(CUDA 13.0)" in printed
    assert "CUDA_VISIBLE_DEVICES=''" in printed and not out.exists()
    assert bench_gpu.main(["--skip-reason"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA device visible")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert bench_gpu.no_gpu_reason() == f"torch {torch.__version__} is built without CUDA"


def test_with_a_gpu_there_is_no_skip_reason(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_gpu.no_gpu_reason() is None
    assert bench_gpu.main(["--skip-reason"]) == 0 and capsys.readouterr().out == "\n"


def test_a_failed_worker_is_a_row_saying_so():
    err = RuntimeError("bf16 compiled failed (exit 1):\nTraceback ...\ntriton.CompilationError: a | b")
    assert bench_gpu.failed_row("ViT-B/16", "bf16 compiled", err) == (
        "| ViT-B/16 | bf16 compiled | failed: triton.CompilationError: a / b | - | - | - | - | - |"
    )


def test_modes_choose_the_configurations_and_a_bad_one_is_refused(monkeypatch, tmp_path, capsys):
    """`--modes` runs only the configurations named, in the table's order; each search after the first starts from
    the first one's batch; the data-wait run takes the fastest bf16 one. An unknown mode stops before any work."""
    asked = []

    def fake_config(recipe, mode, shards, scratch, args):
        def measure(batch):
            asked.append((mode.precision, mode.compiled, batch))
            if batch > 128:
                return None
            step_ms = 100.0 if mode.compiled else 200.0
            return {"step_ms": [step_ms], "peak_allocated_gib": 1.0, "peak_reserved_gib": 2.0}

        return measure

    waits = []
    monkeypatch.setattr(bench_gpu, "measure_config", fake_config)
    monkeypatch.setattr(
        bench_gpu, "data_wait", lambda *a, **kw: waits.append((*a[1:3], kw)) or {"wait": 0.01, "ips": 1, "mfu": None}
    )
    args = bench_gpu.parse_args(["--models", "ViT-B/16", "--modes", "fp32,bf16-compiled", "--start-batch", "64"])
    rows, data = bench_gpu.bench_model("ViT-B/16", args, tmp_path, tmp_path)
    assert [row.split(" | ")[1] for row in rows] == ["bf16 compiled", "fp32 eager (control)"]
    assert asked[:3] == [("bf16", True, 64), ("bf16", True, 128), ("bf16", True, 256)]
    assert [a for a in asked if a[0] == "fp32"][0] == ("fp32", False, 128)  # starts from the compiled batch
    assert waits == [(128, True, {"extra": ()})] and "| 128 |" in data[0]
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--modes", "bf16,fp8"])
    refusal = "--modes: unknown ['fp8']; choose from bf16, bf16-compiled, bf16-compiled-z0, fp32"
    assert refusal in capsys.readouterr().err
