"""bf16 through the DeepSpeed engine's own autocast (core/engine/setup.py `deepspeed_config`), tested with a GPU host's
semantics simulated on CPU. There `torch.is_autocast_enabled()` with no argument reports the accelerator's autocast,
which DeepSpeed's forward reads (deepspeed/runtime/torch_autocast.py): an autocast entered around `engine(...)` is then
switched off inside it unless the config has a `torch_autocast` section. On a CPU host that call reports CUDA's
autocast, so the branch is never taken unless the call is made to report the CPU's, as here.

Recipe: none (an MAE of tests/helpers/models.py's tiny ViT through `parallelize`, one gloo rank)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch
from deepspeed.runtime import torch_autocast
from deepspeed.utils import logger as ds_logger

from core.engine import setup
from core.engine.setup import parallelize, set_tf32
from core.recipe.config import load_config
from pretrain.mae import MAE
from tests.helpers.models import tiny_vit

NESTED_WARNING = "torch.autocast is enabled outside DeepSpeed but disabled within the DeepSpeed engine"


@pytest.fixture
def accelerator_semantics(monkeypatch):
    """`torch.is_autocast_enabled()` (no argument) reports the CPU's autocast, as it reports the GPU's on a GPU host."""
    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: real(*device) if device else real("cpu"))
    monkeypatch.setattr(torch_autocast, "_WARNED_NESTED_AUTOCAST", False)  # DeepSpeed warns once per process
    return real


@pytest.fixture
def ds_warnings():
    """The messages DeepSpeed's logger emits during the test."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    ds_logger.addHandler(handler)
    yield records
    ds_logger.removeHandler(handler)


def _engine(dist, run_dir: Path, *, stage: int, reduce_dtype: str = "bf16"):
    torch.manual_seed(0)
    mae = MAE(tiny_vit(), decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, norm_pix_loss=True)
    overrides = [f"engine.zero_stage={stage}", f"engine.grad_reduce_dtype={reduce_dtype}", "data.global_batch_size=4"]
    cfg = load_config(None, [f"run_dir={run_dir}", "engine.precision=bf16", *overrides])
    engine, _ = parallelize(mae, cfg=cfg, dist=dist, run_dir=run_dir)
    return engine


def _forward(engine, outer_autocast: bool = False) -> tuple[float, set[torch.dtype]]:
    """Loss of one forward on a fixed batch and mask, and the dtypes of what the encoder blocks' Linear layers output
    (the blocks' own outputs are the fp32 residual stream either way)."""
    dtypes: set[torch.dtype] = set()
    linears = [m for m in engine.module.encoder.blocks.modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(lambda m, i, out: dtypes.add(out.dtype)) for m in linears]
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))  # (B, C, H, W)
    torch.manual_seed(2)  # MAE's random mask
    outer = torch.autocast("cpu", dtype=torch.bfloat16) if outer_autocast else contextlib.nullcontext()
    with torch.no_grad(), outer:
        loss = engine({"image": images})["loss"].item()
    for hook in hooks:
        hook.remove()
    return loss, dtypes


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_holds_inside_the_engine_on_an_accelerator_host(
    one_rank, tmp_path, accelerator_semantics, ds_warnings, stage
):
    engine = _engine(one_rank, tmp_path, stage=stage)
    simulated, dtypes = _forward(engine)
    assert dtypes == {torch.bfloat16}
    assert not any(NESTED_WARNING in message for message in ds_warnings)
    # the loss is the one the unsimulated CPU semantics give, so the simulation changes nothing but the check
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "is_autocast_enabled", accelerator_semantics)
        plain, plain_dtypes = _forward(engine)
    assert plain == simulated and plain_dtypes == {torch.bfloat16}


def test_the_simulation_shows_the_old_outer_autocast_train_in_fp32(
    one_rank, tmp_path, accelerator_semantics, ds_warnings, monkeypatch
):
    """The set-up before: an autocast around `engine(...)` and no `torch_autocast` section. On the simulated GPU host
    DeepSpeed switches the autocast off inside the engine and warns: the blocks run in fp32."""
    built = setup.deepspeed_config

    def without_engine_autocast(cfg, world_size):
        return {key: value for key, value in built(cfg, world_size).items() if key != "torch_autocast"}

    monkeypatch.setattr(setup, "deepspeed_config", without_engine_autocast)
    engine = _engine(one_rank, tmp_path, stage=0)
    _, dtypes = _forward(engine, outer_autocast=True)
    assert dtypes == {torch.float32}
    assert any(NESTED_WARNING in message for message in ds_warnings)


@pytest.mark.parametrize(
    ("reduce_dtype", "bucket_dtypes"), [("bf16", {torch.bfloat16, torch.float32}), ("fp32", {torch.float32})]
)
def test_grad_reduce_dtype_picks_the_dtype_zero_reduces_linear_gradients_in(
    one_rank, tmp_path, monkeypatch, reduce_dtype, bucket_dtypes
):
    """Built on one rank with the config of two (one rank reduces nothing, so it keeps everything in fp32)."""
    built = setup.deepspeed_config
    monkeypatch.setattr(
        setup, "deepspeed_config", lambda cfg, world_size: built(cfg, 2) | {"train_micro_batch_size_per_gpu": 4}
    )
    engine = _engine(one_rank, tmp_path, stage=2, reduce_dtype=reduce_dtype)
    assert set(engine.optimizer.ipg_buckets) == bucket_dtypes
    qkv, norm = engine.module.encoder.blocks[0].attn.qkv, engine.module.encoder.blocks[0].norm1
    expected = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
    assert torch_autocast.get_comm_dtype(qkv.weight) == expected and torch_autocast.get_comm_dtype(qkv.bias) == expected
    assert torch_autocast.get_comm_dtype(norm.weight) == torch.float32  # norms are always reduced in fp32


@pytest.fixture
def tf32_flags():
    """The two TF32 flags, restored after the test (monkeypatch cannot undo these module properties)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_switch_applies_on_cuda_only(tf32_flags, enabled):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
    set_tf32(torch.device("cpu"), enabled)
    assert torch.backends.cuda.matmul.allow_tf32 is (not enabled) and torch.backends.cudnn.allow_tf32 is (not enabled)
    set_tf32(torch.device("cuda", 0), enabled)
    assert torch.backends.cuda.matmul.allow_tf32 is enabled and torch.backends.cudnn.allow_tf32 is enabled


def test_one_rank_keeps_its_gradients_in_fp32(one_rank, tmp_path):
    engine = _engine(one_rank, tmp_path, stage=2, reduce_dtype="bf16")
    assert set(engine.optimizer.ipg_buckets) == {torch.float32}


def test_each_weight_is_cast_to_bf16_once_per_micro_step(one_rank, tmp_path):
    """Autocast keeps the bf16 copy of each fp32 weight for the rest of the forward: over two micro-steps (forward and
    backward each) every Linear weight of the objective is cast once per micro-step, never once per use (the
    decoder reads its weights once per block, the encoder the same; a second cast would be a second pass over them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    engine = _engine(one_rank, tmp_path, stage=0)
    weights = {p.data_ptr(): name for name, p in engine.module.named_parameters() if p.ndim == 2}
    casts: dict[str, int] = {}

    class CountCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            source = args[0] if args else None
            to_bf16 = func is torch.ops.aten._to_copy.default and (kwargs or {}).get("dtype") == torch.bfloat16
            if to_bf16 and isinstance(source, torch.Tensor) and source.data_ptr() in weights:
                name = weights[source.data_ptr()]
                casts[name] = casts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))  # (B, C, H, W)
    with CountCasts():
        for _ in range(2):
            engine.backward(engine({"image": images})["loss"])
    linears = {f"{name}.weight" for name, m in engine.module.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(casts) == linears and set(casts.values()) == {2}
