"""benchmarks/gpu_lease.py on the CPU, so that a GPU lease spends no minute on a broken script: real step and trace
arms of the quickstart recipe (the workers the lease starts on the GPU, on the CPU device), the table rewritten after
every arm, an arm past its time killed with its process group, arms beyond the budget not started."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks import gpu_lease
from benchmarks.gpu_lease import ARMS, Arm, Lease, Outcome, render_table, run_logged

QUICK = ("engine.zero_stage=0", "model.img_size=28")


def test_step_and_trace_arms_run_on_the_cpu_and_leave_their_table(tmp_path, monkeypatch):
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path / "cache"))  # the CPU peak behind the MFU, measured here
    monkeypatch.setattr(gpu_lease, "TIMED_STEPS", 4)
    arms = (
        Arm("step", "quickstart eager, ZeRO-0", "step", recipe="quickstart", batch=8, overrides=QUICK),
        Arm("trace", "trace: quickstart", "trace", recipe="quickstart", batch=8, overrides=QUICK),
    )
    lease = Lease(tmp_path / "out", budget_s=600, device="cpu", scratch=tmp_path / "scratch", threads=1)
    step, trace = lease.run(arms)
    assert (step.status, trace.status) == ("done", "done"), (step.note, trace.note)
    assert step.values["images_per_sec"] > 0 and 0 < step.values["mfu"] < 1
    assert step.values["step_ms"] == pytest.approx(8e3 / step.values["images_per_sec"])
    assert math.isfinite(step.values["last_loss"]) and step.values["compile_seconds"] == 0  # eager on a CPU
    summary = (tmp_path / "out" / "trace.md").read_text()
    assert summary.startswith("# trace: quickstart, batch 8") and "no GPU activity" in summary
    assert (tmp_path / "out" / "trace.json.gz").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "lease.json", "lease.log", "lease.md", "trace.json.gz", "trace.md"
    ]  # fmt: skip
    table = (tmp_path / "out" / "lease.md").read_text().splitlines()
    assert table[0] == "# GPU lease (benchmarks/gpu_lease.py)" and "- GPU: no CUDA device" in table[3]
    rows = [line for line in table if line.startswith("| ") and not line.startswith("| arm |")]
    assert rows[0].startswith("| step | quickstart eager, ZeRO-0 | 8 | done | ")
    assert rows[1].startswith("| trace | trace: quickstart | 8 | done | ") and "[summary](trace.md)" in rows[1]
    saved = json.loads((tmp_path / "out" / "lease.json").read_text())
    assert [o["status"] for o in saved] == ["done", "done"] and saved[0]["arm"]["overrides"] == list(QUICK)


@pytest.mark.parametrize(("name", "recipe"), [("d2v", "quickstart_data2vec2"), ("ijepa", "quickstart_ijepa")])
def test_a_teacher_objectives_step_arm_runs_on_the_cpu_with_its_masks_and_teacher(name, recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_lease, "TIMED_STEPS", 3)
    arm = Arm(name, f"quickstart {name} eager, ZeRO-0", "step", recipe=recipe, batch=4, overrides=QUICK)
    lease = Lease(tmp_path / "out", budget_s=600, device="cpu", scratch=tmp_path / "scratch", threads=1)
    (step,) = lease.run((arm,))
    assert step.status == "done", step.note
    assert step.values["images_per_sec"] > 0 and 0 < step.values["mfu"] < 1 and math.isfinite(step.values["last_loss"])
    published = {arm.recipe for arm in ARMS}
    assert {"data2vec2_vitb", "data2vec2_vitl", "ijepa_vith14"} <= published


def test_an_arm_past_its_time_is_killed_with_its_children_and_the_rest_wait_for_budget(tmp_path, monkeypatch):
    spawner = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    spawner += "print('started', flush=True); time.sleep(60)"

    def sleepy(self, arm, timeout):
        run_logged([sys.executable, "-c", spawner], self.out / "lease.log", timeout, {})

    monkeypatch.setattr(Lease, "_step", sleepy)
    monkeypatch.setattr(gpu_lease, "MIN_ARM_S", 4)  # 5 s of budget: the first arm's 2 s leave too little for more
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    lease = Lease(tmp_path / "out", budget_s=5, device="cpu", scratch=tmp_path, threads=1)
    slow, late = lease.run((Arm("slow", "sleeps", "step", cap_s=2), Arm("late", "never starts", "step")))
    assert (slow.status, slow.note) == ("timed out", "timed out after 2 s") and 2 <= slow.seconds < 10
    assert late.status == "not run" and late.note.endswith("s of the budget left")
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(60)" in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [] and {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert "| slow | sleeps | 256 | timed out |" in (tmp_path / "out" / "lease.md").read_text()


def test_the_table_of_a_lease_cut_short():
    arms = {arm.name: arm for arm in ARMS}
    outcomes = [
        Outcome(
            arms["vitl-eager-z1"],
            "done",
            61.0,
            values={
                "images_per_sec": 1900.0,
                "mfu": 0.24,
                "step_ms": 134.7,
                "step_ms_range": [133.0, 140.2],
                "peak_allocated_gib": 24.6,
                "compile_seconds": 0.0,
                "last_loss": 0.98765,
            },
        ),  # fmt: skip
        Outcome(arms["vitl-compiled-z0"], "failed", 12.0, note="exit 1: triton.CompilationError"),
        Outcome(arms["vitl-compiled-z0-b512"], "done", 70.0, values={"oom": True}),
        Outcome(arms["tests"], "not run", note="30 s of the budget left"),
    ]
    assert render_table(outcomes)[2:] == [
        "| vitl-eager-z1 | ViT-L/16 as the recipe ran before: eager, ZeRO-1 | 256 | done | 1900.0 | 24.0% | "
        "134.7 (133.0-140.2) | 24.6 | 0 | 0.9877 | 61 |  |",
        "| vitl-compiled-z0 | ViT-L/16 compiled (the whole step), ZeRO-0 | 256 | failed | - | - | - | - | - | - | 12 | "
        "exit 1: triton.CompilationError |",
        "| vitl-compiled-z0-b512 | ViT-L/16 compiled, ZeRO-0, batch 512 | 512 | done | - | - | - | - | - | - | 70 | "
        "out of memory |",
        "| tests | pytest tests/gpu | 256 | not run | - | - | - | - | - | - | 0 | 30 s of the budget left |",
    ]


def test_arms_are_named_once_and_a_wrong_name_is_refused(capsys):
    assert len({arm.name for arm in ARMS}) == len(ARMS) and ARMS[0].name == "vitl-eager-z1"
    assert [arm.kind for arm in ARMS[:4]] == ["step", "step", "trace", "trace"]  # the headline, then where it goes
    with pytest.raises(SystemExit):
        gpu_lease.parse_args([str(Path("out")), "--arms", "vitl-eager-z1,fast"])
    assert "--arms: unknown ['fast']" in capsys.readouterr().err
