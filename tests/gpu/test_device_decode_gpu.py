"""`data.decode: device` on CUDA (nvJPEG) against the worker path and against the same step on the CPU: the same
(B, 3, H, W) uint8 within a tolerance, a mixed batch in order, a corrupt file counted, the batch's tensors pinned as
the loader pins them. Skipped without a GPU.

nvJPEG's inverse DCT and chroma upsampling are not libjpeg-turbo's, so its pixels differ from the CPU's by a level
here and there before the resize; the resize itself is the same float32 kernel on both devices. The bounds below are
the CPU's (tests/unit/test_device_decode.py) widened for that; a run on a GPU reports what it measured.
"""

from __future__ import annotations

import logging

import pytest
import torch

from data.device import batch_to_device
from data.device_decode import DeviceCrops, decode_crops, stack_images
from tests.unit.test_device_decode import _bad_huffman_table, _batch, _both_crops, _encode, _jpeg, _levels, _photo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _pinned(crops: DeviceCrops) -> DeviceCrops:
    return DeviceCrops(*(t.pin_memory() for t in crops))


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (160, 120), (1024, 768), (2000, 1500)])
def test_nvjpeg_renders_what_the_cpu_and_the_worker_render(size):
    worker, device = _both_crops()
    crops, expected = [], []
    for seed in range(16):
        data = _jpeg(*size, seed=seed)
        torch.manual_seed(seed)
        expected.append(worker(worker.decode(data)))
        torch.manual_seed(seed)
        crops.append(device(device.decode(data)))
    batch = _pinned(stack_images(crops))
    keys = [str(i) for i in range(len(crops))]
    on_cuda, failed = decode_crops(batch, CUDA, keys)
    on_cpu, _ = decode_crops(batch, CPU, keys)
    assert failed == [] and on_cuda.device.type == "cuda" and on_cuda.dtype == torch.uint8
    to_cpu = _levels(on_cuda.cpu(), on_cpu)
    to_worker = _levels(on_cuda.cpu(), torch.stack(expected))
    print(f"{size}: CUDA vs CPU mean {to_cpu.mean():.3f} max {to_cpu.max():.0f}; vs worker {to_worker.mean():.3f}")
    assert to_cpu.mean() < 0.5 and torch.quantile(to_cpu.flatten()[::7], 0.999) <= 3
    assert to_worker.mean() < (0.6 if worker.max_reduction(*size) == 1 else 5)


def test_a_mixed_batch_with_a_corrupt_file_on_cuda(caplog):
    worker, device = _both_crops(64)
    files = [_jpeg(96, 80, 1), _encode(_photo(90, 70, 2), "PNG"), _bad_huffman_table(_jpeg(120, 90, 3))]
    crops = []
    for seed, encoded in enumerate(files):
        torch.manual_seed(seed)
        crops.append(device(device.decode(encoded)))
    batch = _batch(crops, device)
    batch["image"] = _pinned(batch["image"])
    with caplog.at_level(logging.WARNING, logger="data.device_decode"):
        out = batch_to_device(batch, CUDA)
    assert out["image"].device.type == "cuda" and out["image"].shape == (3, 3, 64, 64)
    assert out["image"].isfinite().all()
    reference = batch_to_device(_batch(crops, device), CPU)["image"]  # the CPU counts the bad file as corrupt
    assert (out["image"][:2].cpu() - reference[:2]).abs().max() < 0.1  # normalised units: a few levels at most
    # Whether nvJPEG notices the overflowing Huffman table, or decodes something from it, is its own affair: the run
    # goes on either way; counted and black when it (and then Pillow) refuses it.
    counted = batch["num_corrupt"].item() == 3
    print(f"nvJPEG {'refused' if counted else 'decoded'} the file with a bad Huffman table")
    assert counted == ("s2: corrupt JPEG" in caplog.text)
    if counted:
        assert torch.equal(out["image"][2].cpu(), reference[2])  # black, normalised
