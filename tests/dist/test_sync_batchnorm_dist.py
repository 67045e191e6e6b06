"""Synchronised BatchNorm with real processes (torchrun, gloo): 2 ranks holding 3 and 5 images of a batch normalise,
back-propagate and track running statistics as one BatchNorm2d over all 8."""

from __future__ import annotations

import json

import pytest

from tests.launching import torchrun

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_two_ranks_match_one_batchnorm_over_the_whole_batch(dtype, tolerance):
    out = torchrun("sync_bn_worker.py", dtype, nproc=2).stdout
    (reports,) = [json.loads(line) for line in out.splitlines() if line.startswith("[{")]
    assert sorted(r["rank"] for r in reports) == [0, 1], out
    for report in reports:
        assert report["class"] == "SyncBatchNorm2d" and report["batches_tracked"] == 0
        # bf16 inputs: the statistics are fp32, the inputs and outputs carry bf16's 3 significant digits
        errors = {k: report[k] for k in ("out", "input_grad", "weight_grad", "bias_grad")}
        assert max(errors.values()) < tolerance, report
        # running statistics come from the fp32 statistics of the (bf16-rounded) inputs
        assert report["running_mean"] < (1e-5 if dtype == "float32" else 0.02), report
        assert report["running_var"] < (1e-4 if dtype == "float32" else 0.1), report
