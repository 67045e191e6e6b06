"""Run a stage (`python tests/dist/cpu_fp16.py pretrain|finetune RECIPE [key=value ...]`, under torchrun) with fp16
allowed on this CPU, so that `engine.precision: fp16` is tested without a GPU.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has native fp16 kernels (AVX512-FP16 / AMX-FP16), and
`parallelize` refuses fp16 where the accelerator does not report it. torch's CPU kernels compute in fp16 on any
x86 CPU, only slowly, which is fine for the tiny models of tests/dist: everything else (DeepSpeed's fp16 optimizers,
dynamic loss scaling, overflow skips, the fp32 master weights) is the code a GPU run goes through.
"""

from __future__ import annotations

import runpy
import sys


def allow_cpu_fp16() -> None:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


if __name__ == "__main__":
    allow_cpu_fp16()
    module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__")
