"""`engine.precision: auto`: the precision this machine runs fastest, and whether an explicit one suits it.

    GPU with bf16 (compute capability 8.0 or later: A100, A10, L4, H100, H200, RTX 30xx and later)  -> bf16
    GPU without (V100 7.0, T4 7.5)                                       -> fp16 with dynamic loss scaling
    CPU with native bf16 (x86 AVX512-BF16 or AMX; an Arm CPU's BF16)     -> bf16
    any other CPU                                                        -> fp32

On a CPU without native bf16, torch emulates bf16 matmuls at well under fp32's rate (an Intel Xeon with AVX512 but
no AVX512-BF16: a 1024x1024 matmul at 0.008 TFLOP/s in bf16 against 0.022 in fp32; the quickstart's pretraining at
87-94 images/s against 148), so `auto` takes fp32 there, and an explicit bf16 is warned about. A GPU without bf16 has
none to emulate: an explicit bf16 there is refused.

The launcher's pre-flight asks without torch on a CPU node (`/proc/cpuinfo`, or macOS's sysctl) and with torch on a
GPU node, as `cuda_unusable` does; each rank asks again for its own device (core/engine/precision.py), and writes
the concrete choice into its config, so that run_dir/config.yaml and every checkpoint say what the run used.
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from core.launch.gpus import visible_gpus

CPU_BF16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "bf16": "BF16"}
"""/proc/cpuinfo `flags` (x86) or `Features` (Arm) that mean native bf16 arithmetic, and how to name them."""
BF16_COMPUTE_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bf16 tensor cores (Ampere)."""


@dataclass(frozen=True)
class Machine:
    """What decides the precision: the device kind, its name, and whether it computes bf16 natively."""

    kind: str
    """"cuda" or "cpu"."""
    name: str
    """E.g. "NVIDIA H100 80GB HBM3 (sm_90)" or "AMD EPYC 9R14 (AVX512-BF16)"."""
    bf16: bool


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run uses, why, and what the launch must say about it."""

    precision: str
    reason: str
    """Why this precision, for the plan line."""
    problem: str | None = None
    """Set when the requested precision cannot run here (bf16 on a GPU without it): the launch is refused."""
    warning: str | None = None
    """Set when the requested precision runs here, but slowly (bf16 on a CPU without native bf16)."""


def choose_precision(requested: str, machine: Machine) -> PrecisionChoice:
    """`engine.precision` made concrete for `machine` (see the module docstring)."""
    if requested == "auto":
        if machine.bf16:
            return PrecisionChoice("bf16", f"auto: {machine.name} computes bf16 natively")
        if machine.kind == "cuda":
            return PrecisionChoice("fp16", f"auto: {machine.name} has no bf16; fp16 with dynamic loss scaling")
        return PrecisionChoice("fp32", f"auto: {machine.name} has no native bf16 (AVX512-BF16 or AMX); fp32 is faster")
    if requested != "bf16" or machine.bf16:
        return PrecisionChoice(requested, "as the recipe sets it")
    if machine.kind == "cuda":
        problem = (
            f"bf16 needs a GPU of compute capability 8.0 or later (A100, L4, H100, ...); {machine.name} has none: use "
            "engine.precision=auto (fp16 with dynamic loss scaling on this GPU) or fp16"
        )
        return PrecisionChoice("bf16", "as the recipe sets it", problem=problem)
    warning = (
        f"engine.precision bf16 on {machine.name}, which has no native bf16 (AVX512-BF16 or AMX): torch emulates it, "
        "at about 0.4x fp32's rate on such CPUs; engine.precision=auto picks fp32 here"
    )
    return PrecisionChoice("bf16", "as the recipe sets it", warning=warning)


def cuda_machine(name: str, capability: tuple[int, int]) -> Machine:
    """A GPU by its name and CUDA compute capability (major, minor)."""
    major, minor = capability
    return Machine("cuda", f"{name} (sm_{major}{minor})", tuple(capability) >= BF16_COMPUTE_CAPABILITY)


def cpu_machine(cpuinfo: str | None = None, system: str | None = None) -> Machine:
    """This CPU, from `cpuinfo` (the text of /proc/cpuinfo; read here when None) on Linux, or macOS's sysctl.

    Args:
        cpuinfo: /proc/cpuinfo's text (tests give other machines'); None reads this machine's.
        system: `platform.system()`; None asks.
    """
    system = system or platform.system()
    if system == "Darwin" and cpuinfo is None:
        return _macos_cpu()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return Machine("cpu", f"this {platform.machine() or 'unknown'} CPU (features unknown)", False)
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    model = fields.get("model name") or f"this {platform.machine() or 'unknown'} CPU"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    native = [name for flag, name in CPU_BF16_FLAGS.items() if flag in flags]
    return Machine("cpu", f"{model} ({', '.join(native)})" if native else model, bool(native))


def _macos_cpu() -> Machine:
    """An Apple CPU: native bf16 where sysctl reports FEAT_BF16 (M2 and later)."""

    def sysctl(key: str) -> str:
        try:
            return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    model = sysctl("machdep.cpu.brand_string") or "this Mac's CPU"
    bf16 = sysctl("hw.optional.arm.FEAT_BF16") == "1"
    return Machine("cpu", f"{model} (BF16)" if bf16 else model, bf16)


def launch_machine(device: str) -> Machine:
    """The machine a launch with `engine.device: device` trains on, as the pre-flight sees it: the CPU when the
    device is `cpu` or `auto` finds no GPU this node may use (no torch imported), else the first visible GPU (torch,
    imported only then; the device check has already refused a node whose GPUs torch cannot use)."""
    if device == "cpu" or (device == "auto" and visible_gpus() == 0):
        return cpu_machine()
    import torch

    if not torch.cuda.is_available():  # the device check says why; the CPU is what would run
        return cpu_machine()
    return cuda_machine(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
