"""The CPU peak behind perf/mfu (core/engine/cpu_peak.py): measured, cached per machine, threads, precision and torch,
with when and under what load; measured again by a quieter launch when it was taken under load, and at once when a
run's rate exceeds it; a fake measurement first low, then higher, shows the cache does not freeze a bad draw."""

from __future__ import annotations

import json

import pytest
import torch

from core.engine import cpu_peak
from core.engine.cpu_peak import cpu_peak_cache, measure_cpu_tflops
from core.engine.utilisation import Utilisation, device_peak

CPU = torch.device("cpu")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A cache of the test's own, a load the test sets (`machine.load`), and measurements it scripts
    (`machine.draws`, popped in order; `machine.measured` lists the precisions measured)."""

    class Machine:
        load = 0.1
        draws: list[float] = []
        measured: list[str] = []

    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "_load", lambda: Machine.load)

    def measure(precision, *args, **kwargs):
        Machine.measured.append(precision)
        return Machine.draws.pop(0)

    monkeypatch.setattr(cpu_peak, "measure_cpu_tflops", measure)
    Machine.draws, Machine.measured = [], []
    return Machine


def test_a_matmul_is_measured_and_a_configured_peak_is_used_as_given(monkeypatch, tmp_path):
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path))
    assert 0 < measure_cpu_tflops("bf16", size=256, seconds=0.1) < 1000
    assert 0 < measure_cpu_tflops("fp32", size=256, seconds=0.1) < 1000
    assert device_peak(2.5, "bf16", CPU) == (2.5, "engine.peak_tflops")
    state = torch.get_rng_state()
    peak, source = device_peak(None, "fp32", CPU)
    assert peak > 0 and source.startswith("fp32 1024x1024 matmul measured")
    assert torch.equal(torch.get_rng_state(), state)  # the run's masks and drop paths stay as without measuring


def test_the_peak_is_measured_once_per_machine_threads_and_precision_with_when_and_load(machine):
    machine.draws = [0.25, 0.125, 0.25]
    cache = cpu_peak_cache()
    first = device_peak(None, "bf16", CPU)
    assert first == (0.25, f"bf16 1024x1024 matmul measured at {torch.get_num_threads()} threads")
    again = device_peak(None, "bf16", CPU)
    assert again[0] == 0.25 and again[1].startswith(f"{first[1]}, cached in {cache} (taken ")
    assert again[1].endswith("at load 0.1)") and machine.measured == ["bf16"]
    assert device_peak(None, "fp32", CPU)[0] == 0.125 and machine.measured == ["bf16", "fp32"]
    entries = json.loads(cache.read_text())
    assert len(entries) == 2 and all(f"{torch.get_num_threads()} threads" in k for k in entries)
    assert all(e["load"] == 0.1 and e["how"] == "matmul" and e["measured"] for e in entries.values())
    cache.write_text("{ torn")  # an unreadable cache is measured over and rewritten whole
    assert device_peak(None, "bf16", CPU)[0] == 0.25 and len(machine.measured) == 3
    assert len(json.loads(cache.read_text())) == 1


def test_a_peak_taken_under_load_is_measured_again_by_a_quieter_launch_and_the_better_kept(machine):
    machine.load, machine.draws = 1.4, [0.05, 0.2]
    assert device_peak(None, "bf16", CPU)[0] == 0.05  # a busy moment's draw
    assert device_peak(None, "bf16", CPU)[0] == 0.05 and len(machine.measured) == 1  # still busy: kept, not measured
    machine.load = 0.2
    assert device_peak(None, "bf16", CPU)[0] == 0.2 and len(machine.measured) == 2  # quieter: measured again
    assert device_peak(None, "bf16", CPU)[0] == 0.2 and len(machine.measured) == 2  # taken quiet: kept for good
    (entry,) = json.loads(cpu_peak_cache().read_text()).values()
    assert (entry["tflops"], entry["load"]) == (0.2, 0.2)


def test_an_older_bare_number_counts_as_taken_under_load_and_a_lower_draw_never_replaces_it(machine):
    key = cpu_peak._key("bf16")
    cpu_peak_cache().write_text(json.dumps({key: 0.3}))
    machine.draws = [0.1]
    assert device_peak(None, "bf16", CPU)[0] == 0.3 and machine.measured == ["bf16"]  # measured, the better kept
    (entry,) = json.loads(cpu_peak_cache().read_text()).values()
    assert entry["tflops"] == 0.3 and entry["how"] == "an older measurement" and entry["load"] == 0.1


def test_a_run_faster_than_its_peak_has_it_measured_again_first_low_then_higher(machine):
    machine.draws = [0.01, 0.05]  # first a busy moment's draw, then the machine's real rate
    peak, _ = device_peak(None, "bf16", CPU)
    meter = Utilisation(flops_per_step=1e12, samples_per_step=256, peak_flops=peak * 1e12, measured_precision="bf16")
    # 7.68 images/s: 0.03 TFLOP/s, three times the cached peak: an MFU of 300% cannot be
    assert meter.mfu(7.68) == pytest.approx(3.0)
    line = meter.check_peak(7.68)
    assert meter.peak_flops == pytest.approx(0.05e12) and meter.mfu(7.68) == pytest.approx(0.6)
    assert line.startswith("[mimpipe] perf/mfu: this run reached 0.03 TFLOP/s, above the CPU peak it was measured ")
    assert "measured again: 0.05; the peak is now 0.05 TFLOP/s" in line
    assert device_peak(None, "bf16", CPU)[0] == 0.05 and len(machine.measured) == 2  # the cache holds the new peak
    assert meter.check_peak(7.68) is None and len(machine.measured) == 2  # below 100% now: nothing measured


def test_a_rate_above_even_the_new_measurement_becomes_the_peak_and_other_peaks_are_left_alone(machine):
    machine.draws = [0.02]
    meter = Utilisation(flops_per_step=1e12, samples_per_step=256, peak_flops=0.01e12, measured_precision="bf16")
    meter.check_peak(7.68)  # 0.03 TFLOP/s reached; measured again at 0.02 (still busy)
    assert meter.peak_flops == pytest.approx(0.03e12) and meter.mfu(7.68) == pytest.approx(1.0)
    (entry,) = json.loads(cpu_peak_cache().read_text()).values()
    assert entry["tflops"] == pytest.approx(0.03) and entry["how"].startswith("the rate a run reached")
    datasheet = Utilisation(flops_per_step=1e12, samples_per_step=256, peak_flops=0.01e12)  # a GPU's, or configured
    assert datasheet.check_peak(7.68) is None and datasheet.peak_flops == 0.01e12 and len(machine.measured) == 1


def test_a_cache_that_cannot_be_written_still_gives_the_peak(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(blocker / "cache"))  # a file where the folder would be
    monkeypatch.setattr(cpu_peak, "measure_cpu_tflops", lambda *a, **k: 0.5)
    assert device_peak(None, "bf16", CPU)[0] == 0.5
    assert blocker.read_text() == ""
    monkeypatch.delenv("MIMPIPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_peak_cache() == tmp_path / "xdg" / "mimpipe" / "cpu_peak.json"
