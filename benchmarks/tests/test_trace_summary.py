"""benchmarks/trace_summary.py on a synthetic CUDA trace with known kernels, gaps and launches; on the real CPU trace
of benchmarks/gpu_trace.py's worker (the quickstart recipe on CPU); its kernel classifier on real kernel names."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import gpu_trace, trace_summary
from benchmarks.trace_summary import (
    ATTENTION,
    DEEPSPEED,
    GEMM,
    H2D,
    NORM,
    OPTIMIZER,
    OTHER,
    gpu_kind,
    load_trace,
    render,
    summarize,
    verdict,
)

HOST, AUTOGRAD, STREAM = 1, 2, 7  # the main thread, autograd's device thread, the GPU stream
EVALUATE = "autograd::engine::evaluate_function: "


def host(cat: str, name: str, ts: float, dur: float, tid: int = HOST, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": args}


def gpu(cat: str, name: str, ts: float, dur: float, correlation: int) -> dict:
    args = {"correlation": correlation, "stream": STREAM}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": STREAM, "ts": ts, "dur": dur, "args": args}


def launched(correlation: int, name: str, launch_at: float, start: float, dur: float, **how) -> list[dict]:
    """A GPU activity (`cat`: kernel unless said) and the host call (`api`) on thread `tid` that launched it."""
    api, tid = how.get("api", "cudaLaunchKernel"), how.get("tid", HOST)
    call_cat = "cuda_driver" if api == "cuLaunchKernel" else "cuda_runtime"
    call = host(call_cat, api, launch_at, 4, tid, correlation=correlation)
    return [call, gpu(how.get("cat", "kernel"), name, start, dur, correlation)]


ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor>"
BUCKET_COPY = "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>"
FUSED_ADAM = "void multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"
CUTLASS_GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>"
FLASH_BACKWARD = "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_params>"


def step_3() -> list[dict]:
    """Host span [0, 1000) µs. On the GPU: an H2D copy; the forward's GEMM, attention and a triton layer norm; 70 µs
    idle; backward: a GEMM and an elementwise kernel inside AddmmBackward0 (on autograd's thread), a bucket copy inside
    AccumulateGrad, then NCCL and a device copy after autograd; 30 µs idle; the optimizer step: fused Adam and a copy;
    320 µs idle; a reduction and a memset outside every region. The host waits 60 µs in a stream synchronisation."""
    return [
        host("user_annotation", "ProfilerStep#3", 0, 1000),
        *launched(1, "Memcpy HtoD (Pinned -> Device)", 10, 20, 10, cat="gpu_memcpy", api="cudaMemcpyAsync"),
        *launched(2, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", 50, 60, 100),
        *launched(3, "flash_fwd_kernel", 60, 160, 50),
        *launched(4, "triton_per_fused_native_layer_norm_0", 70, 210, 20, api="cuLaunchKernel"),
        host("user_annotation", "mimpipe/backward", 100, 400),
        host("cpu_op", f"{EVALUATE}AddmmBackward0", 110, 90, AUTOGRAD),
        *launched(5, "nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 120, 300, 100, tid=AUTOGRAD),
        *launched(6, ELEMENTWISE, 130, 400, 10, tid=AUTOGRAD),
        host("cpu_op", f"{EVALUATE}torch::autograd::AccumulateGrad", 210, 50, AUTOGRAD),
        *launched(7, BUCKET_COPY, 220, 410, 20, tid=AUTOGRAD),
        *launched(8, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 420, 430, 40),
        *launched(9, "Memcpy DtoD (Device -> Device)", 440, 470, 10, cat="gpu_memcpy", api="cudaMemcpyAsync"),
        host("user_annotation", "mimpipe/optimizer_step", 500, 300),
        *launched(10, FUSED_ADAM, 510, 510, 60),
        *launched(11, "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>", 520, 570, 20),
        *launched(12, "void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>", 900, 910, 5),
        *launched(13, "Memset (Device)", 905, 915, 2, cat="gpu_memset", api="cudaMemsetAsync"),
        host("cuda_runtime", "cudaStreamSynchronize", 920, 60),
    ]


def step_4() -> list[dict]:
    """Host span [1000, 2000): two kernels back to back from 1100 to 1900 µs."""
    return [
        host("user_annotation", "ProfilerStep#4", 1000, 1000),
        *launched(14, CUTLASS_GEMM, 1010, 1100, 500),
        *launched(15, FLASH_BACKWARD, 1020, 1600, 300),
    ]


def synthetic_trace() -> dict:
    """Two profiled steps, what the profiler adds around them (metadata, flow events, the steps' GPU-side copies),
    and two kernels that belong to neither: one launched during the profiler's warm-up, one whose launch is not in
    the trace."""
    noise = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        gpu("gpu_user_annotation", "ProfilerStep#3", 19, 899, correlation=0),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 2, "pid": 100, "tid": HOST, "ts": 50},
        *launched(98, "sm90_xmma_gemm_early", -50, 5, 3),
        gpu("kernel", "orphan_gemm", 1950, 10, correlation=99),
    ]
    return {"traceEvents": [*noise, *step_3(), *step_4()]}


def test_a_synthetic_cuda_trace_gives_the_known_times_per_kind_gaps_and_verdict():
    s = summarize(synthetic_trace())
    assert s["gpu"] and s["steps"] == [3, 4]
    ms_per_step = {kind: value["ms_per_step"] for kind, value in s["kinds"].items()}
    assert ms_per_step == pytest.approx({
        GEMM: (0.2 + 0.5) / 2, ATTENTION: (0.05 + 0.3) / 2, NORM: 0.035 / 2, OPTIMIZER: 0.06 / 2,
        DEEPSPEED: 0.09 / 2, H2D: 0.01 / 2, OTHER: 0.002 / 2,
    })  # fmt: skip
    assert s["kinds"][GEMM]["share"] == pytest.approx(0.35 / 0.6235)
    assert sum(value["share"] for value in s["kinds"].values()) == pytest.approx(1.0)  # one stream: no overlap
    step3, step4 = s["per_step"]
    # step 3 on the GPU: from its first activity (20) to step 4's first (1100); busy 447 of its 1080 µs
    assert step3.pop("kinds") == pytest.approx({
        GEMM: 0.2, ATTENTION: 0.05, NORM: 0.035, OPTIMIZER: 0.06, DEEPSPEED: 0.09, H2D: 0.01, OTHER: 0.002,
    })  # fmt: skip
    assert step3 == pytest.approx({
        "step": 3, "host_ms": 1.0, "host_sync_ms": 0.06, "gpu_step_ms": 1.08, "gpu_busy_ms": 0.447,
        "gpu_idle_ms": 0.633, "num_kernels": 10,
    })  # fmt: skip
    # the last step: to the end of its host span (2000), after its last kernel (1900)
    assert (step4["gpu_step_ms"], step4["gpu_busy_ms"], step4["gpu_idle_ms"]) == pytest.approx((0.9, 0.8, 0.1))
    assert step4["num_kernels"] == 2 and s["kernels_per_step"] == 6
    assert (s["gpu_busy_ms"], s["gpu_idle_ms"], s["gpu_step_ms"]) == pytest.approx((0.6235, 0.3665, 0.99))
    assert s["idle_share"] == pytest.approx(0.3665 / 0.99)
    assert (s["host_ms"], s["host_sync_ms"]) == pytest.approx((1.0, 0.03))
    assert s["verdict"] == (
        "launch-bound: the GPU idles 37% of its 0.99 ms step while the host is busy 0.97 ms per step issuing work"
    )
    text = render(s)
    assert "| GEMM | 0.35 | 56.1% |" in text and "| optimizer | 0.03 | 4.8% |" in text
    assert "- GPU busy 0.62 ms/step, idle 0.37 ms (37.0% of its 0.99 ms step); 6 kernels/step" in text
    assert "- profiled steps: 2 (ProfilerStep#3-#4)" in text


def test_the_verdict_thresholds():
    assert verdict(idle_share=0.1, host_busy_ms=50.0, gpu_step_ms=40.0) == "GPU-bound: the GPU is busy 90% of its step"
    assert verdict(idle_share=0.5, host_busy_ms=32.0, gpu_step_ms=40.0).startswith("launch-bound: the GPU idles 50%")
    waiting = verdict(idle_share=0.5, host_busy_ms=31.0, gpu_step_ms=40.0)  # 31 < 0.8 x 40: the host waits
    assert waiting.startswith("the GPU idles 50% of its 40.00 ms step, but the host is busy only 31.00 ms per step")


def test_the_cli_reads_plain_and_gzipped_traces(tmp_path, capsys):
    plain, zipped = tmp_path / "trace.json", tmp_path / "trace.json.gz"
    plain.write_text(json.dumps(synthetic_trace()))
    with gzip.open(zipped, "wt") as f:
        json.dump(synthetic_trace(), f)
    assert load_trace(zipped) == load_trace(plain)
    assert trace_summary.main([str(zipped), "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(summarize(synthetic_trace())))
    assert capsys.readouterr().out == (tmp_path / "s.md").read_text() == render(summarize(synthetic_trace()))


def test_a_trace_without_profiler_steps_is_refused():
    with pytest.raises(ValueError, match="no ProfilerStep#N annotation"):
        summarize({"traceEvents": [host("cpu_op", "aten::mm", 0, 10)]})


SM90_GEMM = (
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas"
)


@pytest.mark.parametrize(
    ("name", "kind", "kind_in_deepspeed"),
    [
        (SM90_GEMM, GEMM, GEMM),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", GEMM, GEMM),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>", GEMM, GEMM),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", NORM, DEEPSPEED),
        ("flash_fwd_kernel", ATTENTION, ATTENTION),
        ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_params>", ATTENTION, ATTENTION),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", ATTENTION, ATTENTION),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", ATTENTION, ATTENTION),
        ("triton_per_fused_native_layer_norm_0", NORM, DEEPSPEED),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", NORM, DEEPSPEED),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16>", NORM, DEEPSPEED),
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float>>", OPTIMIZER, OPTIMIZER),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", DEEPSPEED, DEEPSPEED),
        ("Memcpy HtoD (Pinned -> Device)", H2D, H2D),
        ("Memcpy DtoD (Device -> Device)", OTHER, DEEPSPEED),
        ("Memset (Device)", OTHER, DEEPSPEED),
        ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy900, true, float>", OTHER, DEEPSPEED),
    ],
)
def test_kernel_names_are_classified(name, kind, kind_in_deepspeed):
    assert gpu_kind(name) == kind
    assert gpu_kind(name, in_deepspeed=True) == kind_in_deepspeed


def test_the_worker_traces_the_real_loop_on_cpu(tmp_path):
    """The quickstart recipe at batch 8 on CPU: two unrecorded steps (the second the profiler's warm-up), two
    recorded; the trace is read back and holds the worker's regions in every recorded step."""
    out = tmp_path / "out"
    argv = ["--recipe", "quickstart", "--batch", "8", "--device", "cpu", "--warmup", "2", "--steps", "2"]
    assert gpu_trace.main([*argv, "--threads", "2", "--out", str(out)]) == 0
    trace = load_trace(out / "trace.json.gz")
    regions = sorted((e["ts"], e["name"]) for e in trace["traceEvents"] if e.get("cat") == "user_annotation")
    assert [name for _, name in regions if name.startswith(("ProfilerStep", "mimpipe/"))] == [
        "ProfilerStep#2", "mimpipe/backward", "mimpipe/optimizer_step",
        "ProfilerStep#3", "mimpipe/backward", "mimpipe/optimizer_step",
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(summarize(trace)))
    assert not summary["gpu"] and summary["steps"] == [2, 3]
    assert summary["kinds"]["matmul"]["ms_per_step"] > 0 and summary["kinds"]["optimizer"]["ms_per_step"] > 0
    assert sum(value["share"] for value in summary["kinds"].values()) == pytest.approx(1.0)
    assert 0 < summary["cpu_op_ms"] <= summary["host_ms"]
    text = (out / "summary.md").read_text()
    assert text.startswith("# Where the step goes: quickstart, batch 8, bf16, cpu")
    assert "- verdict: no GPU activity recorded (a CPU-only trace)" in text
