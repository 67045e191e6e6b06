"""benchmarks/bench_startup.py's reading of a launch's output: the phases from the arrival times of its lines."""

from __future__ import annotations

import pytest

from benchmarks.bench_startup import read_phases, render

LAUNCH = [
    (0.40, "[mimpipe] plan: 1 node x 1 process per node = world size 1\n"),
    (3.50, "[mimpipe] pre-flight: run_dir writable; data.train: ...\n"),
    (9.60, "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n"),
    (11.00, "[mimpipe] run_dir: 52.4 GB free for 3 checkpoints of about 16.7 MB each\n"),
    (14.00, "[mimpipe] stage pretrain | objective mae | run_dir /tmp/run\n"),
    (14.10, "[mimpipe] world size 1 on cpu | ZeRO-1 | precision bf16\n"),
    (18.75, "[mimpipe] first step: 0.25 s; excluded from perf/images_per_sec and perf/mfu\n"),
    (19.00, "step 2/2  loss 2.046\n"),
]


def test_phases_are_read_off_the_lines_and_the_first_step_began_before_its_line():
    phases = read_phases(LAUNCH)
    assert phases == pytest.approx({"check": 3.5, "engine": 10.5, "loop": 4.5, "total": 18.5})
    row = render({"this tree": [phases, {**phases, "total": 20.0}]})[2]
    assert row.startswith("| this tree | 2 | 3.50 | 10.50 | 4.50 | **19.25** (18.50-20.00) |")


@pytest.mark.parametrize("missing", [("pre-flight",), ("stage pretrain",), ("first step",)])
def test_a_launch_without_a_phase_line_gives_no_phases(missing):
    assert read_phases([(t, line) for t, line in LAUNCH if not any(m in line for m in missing)]) is None
