"""The peak of a CPU behind `perf/mfu`: a matmul measured, kept in a cache file, and measured again when it proves low.

A measurement taken while the machine is busy (other jobs, a launch's own data workers) comes out low, and a cache
that kept the first draw would freeze it: every later run on the machine would report an MFU several times too high
(seen: 0.0478 TFLOP/s cached from a busy moment). So:
- a measurement is the best of several short matmul trials spread over a second (`measure_cpu_tflops`);
- the cache entry says when it was taken and under what load (the 1-minute load average against the cores); an entry
  taken under load (at least half the cores busy) is measured again by a later launch that finds the machine
  quieter, and the better of the two is kept;
- a run whose achieved FLOP rate exceeds the peak (an MFU above 100%, which cannot be) has it measured again at once,
  and the peak becomes the larger of the new measurement and the rate the run reached (`raise_cpu_peak`).
An entry is per CPU model, thread count, precision and torch version: `cpu_peak_cache()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from core.engine.compiled import cache_root

MATMUL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BUSY_SHARE = 0.5
"""A measurement taken with the 1-minute load average at or above this share of the cores counts as taken under load."""


def measure_cpu_tflops(precision: str, size: int = 1024, seconds: float = 1.0) -> float:
    """Best TFLOP/s of repeated `size`-square matmuls in `precision`'s dtype at the current thread count.

    Trials of about a tenth of a second each run for `seconds` in all (at least three); the best one counts, as the
    closest to what the hardware can do.
    """
    dtype = MATMUL_DTYPES[precision]
    gen = torch.Generator().manual_seed(0)  # its own generator: the run's RNG draws stay as without measuring
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    t0 = time.perf_counter()
    a @ b  # warm-up, and a first timing to size the trials
    reps = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    best, start, trials = float("inf"), time.perf_counter(), 0
    while trials < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t0) / reps)
        trials += 1
    return 2 * size**3 / best / 1e12


def cpu_peak_cache() -> Path:
    """The file of measured CPU peaks: in $MIMPIPE_CACHE_DIR, else $XDG_CACHE_HOME/mimpipe, else ~/.cache/mimpipe."""
    return cache_root() / "cpu_peak.json"


def _key(precision: str) -> str:
    return f"{_cpu_model()} | {torch.get_num_threads()} threads | {precision} | torch {torch.__version__}"


def _what(precision: str) -> str:
    return f"{precision} 1024x1024 matmul measured at {torch.get_num_threads()} threads"


def _load() -> float:
    """The 1-minute load average over the cores: 1.0 is every core busy."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def _read() -> dict:
    try:
        cached = json.loads(cpu_peak_cache().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _entry(cached: dict, key: str) -> dict | None:
    """The cache's entry for `key`: {"tflops", "measured", "load", "how"}; an entry of an older mimpipe (a bare
    number, conditions unknown) counts as taken under load."""
    entry = cached.get(key)
    if isinstance(entry, (int, float)):
        entry = {"tflops": float(entry), "measured": None, "load": None, "how": "an older measurement"}
    if not isinstance(entry, dict) or not isinstance(entry.get("tflops"), (int, float)) or entry["tflops"] <= 0:
        return None
    return entry


def _store(key: str, entry: dict) -> None:
    """Write `entry` under `key`, the file replaced whole (ranks writing at once each leave a whole file); a cache that
    cannot be written is left as it is."""
    path = cpu_peak_cache()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**_read(), key: entry}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _measured(precision: str, how: str) -> dict:
    load = _load()
    tflops = measure_cpu_tflops(precision)
    return {"tflops": tflops, "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load": round(load, 2), "how": how}


def _under_load(entry: dict) -> bool:
    return entry["load"] is None or entry["load"] >= BUSY_SHARE


def cached_cpu_tflops(precision: str) -> tuple[float, str]:
    """The CPU's peak in `precision` at the current thread count, and where it came from: the cache's entry, measured
    (again) when there is none or it was taken under load and the machine is quieter now (the better one kept)."""
    key, path = _key(precision), cpu_peak_cache()
    entry = _entry(_read(), key)
    if entry is not None and not (_under_load(entry) and _load() < BUSY_SHARE):
        taken = f"taken {entry['measured']} at load {entry['load']}" if entry["measured"] else entry["how"]
        return entry["tflops"], f"{_what(precision)}, cached in {path} ({taken})"
    fresh = _measured(precision, "matmul")
    if entry is not None and entry["tflops"] > fresh["tflops"]:
        fresh = {**entry, "load": fresh["load"] if entry["load"] is None else entry["load"]}
    _store(key, fresh)
    return fresh["tflops"], _what(precision)


def raise_cpu_peak(precision: str, achieved_tflops: float, peak_tflops: float) -> tuple[float, str]:
    """A run reached `achieved_tflops`, above the peak it was measured against: measure again, and keep (and cache)
    the largest of the new measurement, the rate reached and the old peak. Returns the peak and the line saying so."""
    fresh = _measured(precision, "matmul, measured again when a run's rate exceeded the peak")
    measured = fresh["tflops"]
    tflops = max(measured, achieved_tflops, peak_tflops)
    if tflops > measured:
        fresh = {**fresh, "tflops": tflops, "how": "the rate a run reached, above the matmul measured again"}
    _store(_key(precision), fresh)
    line = (
        f"[mimpipe] perf/mfu: this run reached {achieved_tflops:.4g} TFLOP/s, above the CPU peak it was measured "
        f"against ({peak_tflops:.4g}: a busy moment's draw); measured again: {measured:.4g}; the peak is now "
        f"{tflops:.4g} TFLOP/s (cached in {cpu_peak_cache()})"
    )
    return tflops, line


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else f"{os.uname().machine} CPU"
