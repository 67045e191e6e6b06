"""core/compat/deepspeed.py: every patch's check passes on the installed DeepSpeed, and fails loudly, naming the patch,
what changed and the installed version, when the internal it relies on is missing or changed shape. The changes are
made with monkeypatch on the installed classes and modules (an attribute removed, a method swapped for a stand-in),
so each case is a DeepSpeed release that differs in exactly that internal."""

from __future__ import annotations

import ast
import copy
import importlib
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
import torch

from core.compat import deepspeed as ds_compat
from core.compat.deepspeed import PATCHES, DeepSpeedCompatError
from core.engine.distributed import DistInfo
from core.engine.setup import parallelize
from core.recipe.config import load_config
from pretrain.mae import MAE
from tests.compat_checks import assert_check_fails
from tests.helpers.models import tiny_vit

REPO = Path(__file__).resolve().parents[2]

STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
INIT = "deepspeed.runtime.zero.partition_parameters.Init"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"


def _owner(path: str):
    """The installed class or module that `path` ('package.module.Class' or 'package.module') names."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)


def _fails(patch: str, *phrases: str) -> None:
    """Asserts the patch's check raises an error naming the patch, the installed version and each phrase."""
    named = (f"DeepSpeed patch '{patch}'", f"installed deepspeed {deepspeed.__version__}")
    assert_check_fails(PATCHES[patch].check, DeepSpeedCompatError, *named, *phrases)


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_every_check_passes_on_the_installed_deepspeed(name):
    PATCHES[name].check()


def test_check_runs_every_patch_and_each_has_its_class():
    ds_compat.check()
    assert {name: patch.kind for name, patch in PATCHES.items()} == {
        "zero3_param_attributes": "correctness",
        "zero_init_apply": "correctness",
        "fp32_master_shared": "memory",
        "zero12_master_shared": "memory",
        "skip_identity_grad_passes": "speed",
        "single_rank_no_allreduce": "speed",
        "zero0_fp16_loss_scale": "correctness",
        "zero0_fp16_masters": "correctness",
        "fp16_skipped_steps": "correctness",
        "checkpoint_files": "correctness",
        "checkpoint_writes": "correctness",
    }
    optional = {name for name, patch in PATCHES.items() if patch.kind != "correctness"}
    assert set(ds_compat.SETTINGS) == optional  # each memory and speed patch has its engine setting
    engine = load_config(None, []).engine
    on_by_default = {setting for setting in ds_compat.SETTINGS.values() if getattr(engine, setting)}
    assert on_by_default == {"skip_single_rank_allreduce"}  # the others are off by default


def test_a_run_checks_only_the_correctness_patches_it_needs():
    assert set(ds_compat.needed(1, "bf16")) == {"checkpoint_files", "checkpoint_writes"}
    zero3_fp16 = set(ds_compat.needed(3, "fp16")) - {"checkpoint_files", "checkpoint_writes"}
    assert zero3_fp16 == {"zero3_param_attributes", "zero_init_apply", "zero0_fp16_loss_scale", "zero0_fp16_masters",
                          "fp16_skipped_steps"}  # fmt: skip


# One internal per patch, removed: (patch, owner, attribute).
MISSING = [
    ("zero3_param_attributes", INIT, "_convert_to_deepspeed_param"),
    ("zero_init_apply", INIT, "override_module_apply"),
    ("zero_init_apply", "deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses",
     "patch_init_and_builtins"),
    ("fp32_master_shared", STAGE3, "_create_fp32_partitions"),
    ("zero12_master_shared", ZERO12, "_link_all_hp_params"),
    ("skip_identity_grad_passes", STAGE3, "_get_norm_groups"),
    ("skip_identity_grad_passes", STAGE3, "unscale_and_clip_grads"),
    ("single_rank_no_allreduce", ENGINE, "_backward_epilogue"),
    ("zero0_fp16_loss_scale", "deepspeed.runtime.base_optimizer", "ZeROOptimizer"),
    ("zero0_fp16_loss_scale", "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer", "loss_scale"),
    ("zero0_fp16_masters", UNFUSED, "state_dict"),
    ("fp16_skipped_steps", ENGINE, "_take_model_step"),
    ("checkpoint_files", ENGINE, "_get_ckpt_name"),
    ("checkpoint_files", "deepspeed.checkpoint.ds_to_universal", "parse_arguments"),
    ("checkpoint_writes", ENGINE, "_save_zero_checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(("patch", "owner", "attribute"), MISSING)
def test_a_missing_internal_fails_naming_patch_attribute_and_version(monkeypatch, patch, owner, attribute):
    monkeypatch.delattr(_owner(owner), attribute)
    _fails(patch, f"{attribute} is missing")


def test_a_missing_module_fails_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.checkpoint.ds_to_universal", None)  # import raises ImportError
    _fails("checkpoint_files", "module deepspeed.checkpoint.ds_to_universal cannot be imported")


def test_a_changed_signature_fails(monkeypatch):
    monkeypatch.setattr(_owner(STAGE3), "_create_fp32_partitions", lambda self, device: None)
    _fails("fp32_master_shared", "now takes (self, device), where the patch expects (self)")
    monkeypatch.setattr(_owner(STAGE3), "unscale_and_clip_grads", lambda self, sub_group_id, norm_groups: None)
    _fails("skip_identity_grad_passes", "unscale_and_clip_grads now takes (self, sub_group_id, norm_groups)")


def test_a_step_that_no_longer_calls_the_replaced_method_fails(monkeypatch):
    """The patch assigns `_get_norm_groups` on the optimizer: a step that computes the norm some other way would
    silently ignore it."""

    def step(self, closure=None):
        return self.unscale_and_clip_grads(0, self._global_norm())

    monkeypatch.setattr(_owner(STAGE3), "step", step)
    _fails("skip_identity_grad_passes", "step no longer uses _get_norm_groups, combine_grad_norm_groups")


def test_parameters_without_the_status_attribute_fail(monkeypatch):
    def convert(self, param):
        param.ds_id, param.ds_tensor, param.ds_numel, param.ds_shape = 0, None, 0, param.shape

    monkeypatch.setattr(_owner(INIT), "_convert_to_deepspeed_param", convert)
    _fails("zero3_param_attributes", "no longer uses ds_status")


def test_an_engine_backward_that_scales_fp16_losses_itself_fails(monkeypatch):
    """What deepspeedai/DeepSpeed PR #8393 would change: the loop's own loss scaling would then scale twice."""

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        if isinstance(self.optimizer, deepspeed.runtime.base_optimizer.ZeROOptimizer):
            loss = self.optimizer.scale_if_loss(loss)
        elif self.fp16_enabled() and not self.zero_optimization():
            loss = loss * self.optimizer.cur_scale
        loss.backward(retain_graph=retain_graph)

    monkeypatch.setattr(_owner(ENGINE), "backward", backward)
    _fails("zero0_fp16_loss_scale", "scales fp16 losses itself")


def test_an_engine_that_no_longer_counts_skipped_steps_fails(monkeypatch):
    """A step that skips on overflow without counting it: train/skipped_steps would stay 0 while steps are lost."""

    def take_model_step(self, lr_kwargs):
        self.optimizer.step()
        self._step_applied = not getattr(self.optimizer, "overflow", False)

    monkeypatch.setattr(_owner(ENGINE), "_take_model_step", take_model_step)
    _fails("fp16_skipped_steps", "_take_model_step no longer uses overflow, skipped_steps")
    assert ds_compat.skipped_steps(SimpleNamespace(skipped_steps=3)) == 3


def test_a_renamed_checkpoint_key_fails(monkeypatch):
    def state_dict(self):
        return {"fp32_master_groups": self.fp32_groups}

    monkeypatch.setattr(_owner(UNFUSED), "state_dict", state_dict)
    _fails("zero0_fp16_masters", "state_dict no longer has the string fp32_groups")


def test_renamed_checkpoint_files_fail(monkeypatch):
    monkeypatch.setattr(_owner(ENGINE), "_get_ckpt_name", lambda self, path, tag: f"{path}/{tag}/model_states_00.pt")
    _fails("checkpoint_files", "model states are saved as model_states_00.pt, not mp_rank_00_model_states.pt")
    monkeypatch.undo()
    monkeypatch.setattr(_owner(ENGINE), "_get_zero_ckpt_prefix", lambda self, dp_rank, bf16_mode: f"dp{dp_rank}")
    _fails("checkpoint_files", "ZeRO shards are saved as dp0_optim_states.pt, which *zero_pp_rank_* does not match")


def test_a_converter_without_a_flag_we_pass_fails(monkeypatch):
    """A stand-in ds_to_universal module whose command line lacks --inject_missing_state."""
    stand_in = types.ModuleType("deepspeed.checkpoint.ds_to_universal")

    def parse_arguments():
        return ["--input_folder", "--output_folder", "--num_extract_workers", "--num_merge_workers"]

    stand_in.main, stand_in.parse_arguments = (lambda args=None: None), parse_arguments
    monkeypatch.setitem(sys.modules, "deepspeed.checkpoint.ds_to_universal", stand_in)
    _fails("checkpoint_files", "parse_arguments no longer has the string --inject_missing_state")


def test_parallelize_runs_the_checks_before_anything_else(monkeypatch, tmp_path):
    monkeypatch.delattr(_owner(INIT), "_convert_to_deepspeed_param")  # a correctness patch of every ZeRO-3 run
    cfg = load_config(None, [f"run_dir={tmp_path}", "engine.zero_stage=3"])
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(DeepSpeedCompatError, match=re.escape("'zero3_param_attributes'")):
        parallelize(torch.nn.Linear(2, 2), cfg=cfg, dist=dist, run_dir=tmp_path)
    assert not (tmp_path / "deepspeed.json").exists()  # refused before anything was written


def test_identity_grad_passes_are_dropped_only_without_clipping_or_loss_scaling():
    def zero3(**settings):  # a stand-in ZeRO-3 optimizer with the attributes the patch reads
        partitions = [torch.ones(3)]
        base = dict(clip_grad=0.0, dynamic_loss_scale=False, loss_scale=1.0, fp32_partitioned_groups_flat=partitions)
        return SimpleNamespace(**{**base, **settings})

    plain = zero3()
    assert ds_compat.skip_identity_grad_passes(plain)
    assert [n.item() for n in plain._get_norm_groups()] == [0.0]
    assert plain.unscale_and_clip_grads(0, torch.tensor(5.0)) is None
    for settings in ({"clip_grad": 1.0}, {"dynamic_loss_scale": True}, {"loss_scale": 2.0**16}):
        kept = zero3(**settings)
        assert not ds_compat.skip_identity_grad_passes(kept)
        assert not hasattr(kept, "_get_norm_groups")


def test_single_rank_allreduce_is_dropped_only_at_zero0_on_one_rank():
    def engine(stage: int, world_size: int):  # a stand-in engine with what the patch reads
        return SimpleNamespace(
            zero_optimization_stage=lambda: stage, dp_world_size=world_size, enable_backward_allreduce=True
        )

    alone = engine(0, 1)
    assert ds_compat.skip_single_rank_allreduce(alone) and not alone.enable_backward_allreduce
    for stage, world_size in ((0, 2), (1, 1), (2, 1), (3, 1)):  # ZeRO-1/2/3 partition gradients in that reduction
        kept = engine(stage, world_size)
        assert not ds_compat.skip_single_rank_allreduce(kept) and kept.enable_backward_allreduce


def _trained(dist, run_dir: Path, stage: int, *settings: str, steps: int = 4):
    """(engine, model, its initial weights) after `steps` bf16-autocast AdamW steps of a small MLP through
    `parallelize` at `stage`, with the engine `settings` turned on (or set as given: `name=false`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    initial = [p.detach().clone() for p in model.parameters()]
    overrides = [f"run_dir={run_dir}", f"engine.zero_stage={stage}", "data.global_batch_size=4"]
    cfg = load_config(None, [*overrides, *(f"engine.{s}" if "=" in s else f"engine.{s}=true" for s in settings)])
    engine, optimizer = parallelize(model, cfg=cfg, dist=dist, run_dir=run_dir)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(torch.randn(4, 8)).float().pow(2).mean()
        engine.backward(loss)
        with optimizer.guard(skip=False):
            engine.step()
    return engine, model, initial


def _assert_same_training(patched: torch.nn.Module, plain: torch.nn.Module, initial: list[torch.Tensor]) -> None:
    """Both runs end on the same bits, and every parameter moved."""
    assert all(torch.equal(a, b) for a, b in zip(patched.parameters(), plain.parameters(), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(patched.parameters(), initial, strict=True))


def test_one_rank_zero0_trains_the_same_without_the_allreduce(one_rank, tmp_path):
    """engine.skip_single_rank_allreduce changes no bit of a one-rank ZeRO-0 run: four steps with and without it."""
    engine, patched, initial = _trained(one_rank, tmp_path, 0, "skip_single_rank_allreduce")
    assert not engine.enable_backward_allreduce
    engine, plain, _ = _trained(one_rank, tmp_path, 0, "skip_single_rank_allreduce=false")
    assert engine.enable_backward_allreduce  # DeepSpeed's own backward
    _assert_same_training(patched, plain, initial)
    engine, _, _ = _trained(one_rank, tmp_path, 0)
    assert not engine.enable_backward_allreduce  # on by default


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_steps_the_parameters_themselves_and_trains_the_same(one_rank, tmp_path, stage):
    """With engine.share_zero12_masters the ZeRO-1/2 optimizer's fp32 partition is the parameters' own storage, what
    DeepSpeed reports as each parameter's fp32 value is the parameter, and four AdamW steps end on the same bits as
    DeepSpeed's own step with its master copy (the default)."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine, patched, initial = _trained(one_rank, tmp_path, stage, "share_zero12_masters")
    zero = engine.optimizer
    for master, flat, group in zip(
        zero.single_partition_of_fp32_groups, zero.bit16_groups_flat, zero.optimizer.param_groups, strict=True
    ):
        assert master.data_ptr() == flat.data_ptr() and master.numel() == flat.numel()  # one rank: the whole buffer
        assert group["params"] == [master] and master in zero.optimizer.state
    assert all(torch.equal(safe_get_full_fp32_param(p), p) for p in patched.parameters())

    engine, plain, _ = _trained(one_rank, tmp_path, stage)
    zero = engine.optimizer
    assert all(
        m.data_ptr() != f.data_ptr()
        for m, f in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups_flat, strict=True)
    )
    _assert_same_training(patched, plain, initial)


def _zero3_weights(engine) -> list[torch.Tensor]:
    """The full fp32 weights of a one-rank ZeRO-3 engine's module (its partitions are the whole parameters)."""
    return [p.ds_tensor.detach().clone().view(p.ds_shape) for p in engine.module.parameters()]


@pytest.mark.parametrize("setting", ["share_zero3_masters", "skip_identity_grad_passes"])
def test_zero3_patches_train_the_same_as_deepspeeds_own_step(one_rank, tmp_path, setting):
    """Each ZeRO-3 patch, on: four AdamW steps end on the same bits as DeepSpeed's own step (the default, off); the
    masters are the parameter partitions themselves, or the norm and unscale are replaced on the optimizer."""
    engine, _, initial = _trained(one_rank, tmp_path, 3, setting)
    zero = engine.optimizer
    shares = [
        m.data_ptr() == p.data_ptr()
        for m, p in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True)
    ]
    skips = "_get_norm_groups" in vars(zero) and "unscale_and_clip_grads" in vars(zero)
    assert (all(shares), skips) == (setting == "share_zero3_masters", setting == "skip_identity_grad_passes")
    patched = _zero3_weights(engine)
    engine, _, _ = _trained(one_rank, tmp_path, 3)
    zero = engine.optimizer
    assert not any(
        m.data_ptr() == p.data_ptr()
        for m, p in zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True)
    )
    assert "_get_norm_groups" not in vars(zero)
    plain = _zero3_weights(engine)
    assert all(torch.equal(a, b) for a, b in zip(patched, plain, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(patched, initial, strict=True))


def test_zero12_masters_are_not_shared_with_offload_or_fp16_weights():
    def zero(**settings):  # a stand-in ZeRO-1/2 optimizer with what the patch reads before it changes anything
        return SimpleNamespace(**{"cpu_offload": False, "bit16_groups_flat": [torch.ones(3)], **settings})

    assert not ds_compat.share_zero12_masters(zero(cpu_offload=True))
    assert not ds_compat.share_zero12_masters(zero(bit16_groups_flat=[torch.ones(3, dtype=torch.float16)]))


def test_a_backward_that_reduces_without_the_flag_fails(monkeypatch):
    """A release whose backward reduced gradients whatever `enable_backward_allreduce` says would ignore the patch."""

    def backward_epilogue(self):
        self.allreduce_gradients()

    monkeypatch.setattr(_owner(ENGINE), "_backward_epilogue", backward_epilogue)
    _fails("single_rank_no_allreduce", "_backward_epilogue no longer uses enable_backward_allreduce")


def test_zero3_parameter_attributes_on_plain_and_stand_in_parameters():
    plain = torch.nn.Parameter(torch.zeros(4, 3))
    assert not ds_compat.is_zero3_param(plain) and not ds_compat.is_released(plain)
    assert ds_compat.full_shape(plain) == (4, 3)
    partitioned = torch.nn.Parameter(torch.zeros(6))  # this rank's half of a (4, 3) weight
    released = importlib.import_module("deepspeed.runtime.zero.partition_parameters").ZeroParamStatus.NOT_AVAILABLE
    partitioned.ds_id, partitioned.ds_shape, partitioned.ds_status = 7, torch.Size((4, 3)), released
    partitioned.ds_tensor, partitioned.ds_numel = torch.zeros(6), 12
    assert ds_compat.is_zero3_param(partitioned) and ds_compat.is_released(partitioned)
    assert ds_compat.full_shape(partitioned) == (4, 3)
    module = torch.nn.Module()
    module.weight = partitioned
    assert ds_compat.is_partitioned(module) and ds_compat.partition_sizes(module) == (6, 12)
    assert ds_compat.partition_report(module) == "this rank holds 6 of 12 parameters (50.0%)"


@pytest.mark.parametrize("name", ["mae", "beit", "encoder", "tokenizer", "targets"])
def test_objectives_import_no_engine_deepspeed_or_process_group(name):
    """The objectives are plain models: distribution is applied to them from core/engine."""
    tree = ast.parse((REPO / "pretrain" / f"{name}.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    forbidden = ("deepspeed", "core.engine", "torch.distributed")
    assert [m for m in imported if m.startswith(forbidden)] == []


def test_mae_init_touches_only_the_visited_modules_own_weights(monkeypatch):
    """What ZeRO-3 construction relies on (patch `zero_init_apply`): inside deepspeed.zero.Init, `Module.apply` lends
    each visited module the full values of its own parameters only, every other parameter being an empty partition.
    A stand-in of that `apply` on one process gives MAE's init the same values as the ordinary call."""
    reference = MAE(tiny_vit(seed=0), decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2)
    partitioned = copy.deepcopy(reference)
    torch.manual_seed(1)
    reference.init_weights()

    full = {p: p.data for p in partitioned.parameters()}
    for p in full:
        p.data = torch.empty(0)

    def gathering_apply(module: torch.nn.Module, fn):
        for child in module.children():
            gathering_apply(child, fn)
        own = list(module.parameters(recurse=False))
        for p in own:
            p.data = full[p]
        fn(module)
        for p in own:
            full[p], p.data = p.data, torch.empty(0)
        return module

    monkeypatch.setattr(torch.nn.Module, "apply", gathering_apply)
    torch.manual_seed(1)
    partitioned.init_weights()
    for p in full:
        p.data = full[p]
    expected = reference.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in partitioned.state_dict().items())
    assert not partitioned.encoder.pos_embed.requires_grad


UNCHECKED = "0.20.0"


@pytest.fixture
def unchecked_release(monkeypatch):
    """The installed DeepSpeed reporting a release the patches were not checked against; nothing warned yet."""
    monkeypatch.setattr(deepspeed, "__version__", UNCHECKED)
    monkeypatch.setattr(ds_compat, "_warned", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ds_compat.__name__ and r.levelname == "WARNING"]


def test_an_unchecked_release_skips_each_memory_and_speed_patch_with_one_warning(unchecked_release, caplog):
    for name, setting in ds_compat.SETTINGS.items():
        with pytest.raises(DeepSpeedCompatError):
            PATCHES[name].check()
        assert not ds_compat.applies(name) and not ds_compat.applies(name)
        warned = [m for m in _warnings(caplog) if f"'{name}'" in m]
        assert len(warned) == 1 and "\n" not in warned[0], warned
        assert UNCHECKED in warned[0] and f"engine.{setting}" in warned[0] and "Skipped" in warned[0]


def test_a_changed_internal_skips_a_memory_patch_instead_of_stopping(monkeypatch, caplog):
    monkeypatch.setattr(ds_compat, "_warned", set())
    monkeypatch.delattr(_owner(STAGE3), "_create_fp32_partitions")
    assert not ds_compat.applies("fp32_master_shared")
    assert any("_create_fp32_partitions is missing" in m and "Skipped" in m for m in _warnings(caplog))


def test_an_unchecked_release_trains_without_the_memory_patch(one_rank, tmp_path, unchecked_release, caplog):
    """A ZeRO-2 launch asking for share_zero12_masters on an unchecked release goes on with DeepSpeed's own master
    copy, and trains the same; the checkpoint patches it needs warn that they were checked on 0.19 only."""
    engine, patched, initial = _trained(one_rank, tmp_path, 2, "share_zero12_masters")
    zero = engine.optimizer
    assert all(
        m.data_ptr() != f.data_ptr()
        for m, f in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups_flat, strict=True)
    )
    warned = _warnings(caplog)
    assert {name for name in ("checkpoint_files", "checkpoint_writes", "zero12_master_shared")
            if any(f"'{name}'" in m and UNCHECKED in m for m in warned)} == {
        "checkpoint_files", "checkpoint_writes", "zero12_master_shared"}  # fmt: skip
    assert not any(torch.equal(a, b) for a, b in zip(patched.parameters(), initial, strict=True))


@pytest.mark.parametrize("name", [n for n, p in PATCHES.items() if p.kind == "correctness" and p.stops_unchecked])
def test_an_unchecked_release_stops_at_a_correctness_patch_whose_change_would_be_silent(unchecked_release, name):
    named = (f"DeepSpeed patch '{name}'", f"installed deepspeed {UNCHECKED}", "install deepspeed>=0.19,<0.20")
    assert_check_fails(PATCHES[name].check, DeepSpeedCompatError, *named)


def test_an_unchecked_release_stops_an_fp16_launch_before_anything_is_written(unchecked_release, tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "engine.zero_stage=0", "engine.precision=fp16"])
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(DeepSpeedCompatError, match=re.escape("'zero0_fp16_loss_scale'")):
        parallelize(torch.nn.Linear(2, 2), cfg=cfg, dist=dist, run_dir=tmp_path)
    assert not (tmp_path / "deepspeed.json").exists()


def test_optional_patch_settings_are_refused_at_a_stage_they_do_not_apply_to():
    for setting, stage in (("share_zero3_masters", 1), ("share_zero12_masters", 3), ("skip_identity_grad_passes", 2)):
        with pytest.raises(ValueError, match=f"engine.{setting} needs engine.zero_stage"):
            load_config(None, [f"engine.zero_stage={stage}", f"engine.{setting}=true"])


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_trains_the_same_without_overlapped_reduction(one_rank, tmp_path, monkeypatch, stage):
    """One rank has nothing to reduce while backward runs, so `overlap_comm` (whose side stream DeepSpeed waits for
    before each bucket) is off there; four steps end on the same bits as with it on, DeepSpeed's own setting."""
    from core.engine import setup

    engine, plain, initial = _trained(one_rank, tmp_path, stage)
    assert not engine.optimizer.overlap_comm
    config = setup.deepspeed_config

    def overlapped(cfg, world_size: int) -> dict:
        ds = config(cfg, world_size)
        return {**ds, "zero_optimization": {**ds["zero_optimization"], "overlap_comm": True}}

    monkeypatch.setattr(setup, "deepspeed_config", overlapped)
    engine, with_overlap, _ = _trained(one_rank, tmp_path, stage)
    assert engine.optimizer.overlap_comm
    _assert_same_training(plain, with_overlap, initial)
