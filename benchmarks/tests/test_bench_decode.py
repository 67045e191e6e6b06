"""benchmarks/bench_decode.py's own logic: its section of the results file replaced in place (benchmarks/workers.py
`replace_section`, which bench_write shares), and the device step timed on batches larger than the images
generated."""

from __future__ import annotations

import torch

from benchmarks.bench_decode import BEGIN, END, device_rates, jpegs_of_size
from benchmarks.workers import replace_section


def test_the_section_is_appended_once_then_replaced_in_place(tmp_path):
    path = tmp_path / "data.md"
    path.write_text("# Data path\n\ntable\n")
    replace_section(path, f"{BEGIN}\nfirst\n{END}", BEGIN, END)
    path.write_text(path.read_text() + "\n<!-- another: begin -->\nkept\n")
    replace_section(path, f"{BEGIN}\nsecond\n{END}", BEGIN, END)
    text = path.read_text()
    assert text.startswith("# Data path\n\ntable\n") and "first" not in text and text.count(BEGIN) == 1
    assert text.index("second") < text.index("kept")
    replace_section(tmp_path / "new.md", f"{BEGIN}\nonly\n{END}", BEGIN, END)
    assert (tmp_path / "new.md").read_text() == f"{BEGIN}\nonly\n{END}\n"


def test_device_rates_fill_a_batch_larger_than_the_images():
    jpegs = jpegs_of_size((120, 90), 3, seed=0)
    rates = device_rates(jpegs, torch.device("cpu"), batch=4, repeats=1)
    assert rates["decode_per_s"] > 0 and rates["decode_crops_per_s"] > 0 and rates["decode_crops_cpu_ms_per_batch"] > 0
