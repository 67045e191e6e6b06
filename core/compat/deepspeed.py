"""Every place the engine relies on DeepSpeed internals, each a named `Patch` with a `check()` and a class.

The engine patches or reads DeepSpeed (written against 0.19) where its public API does not reach: private methods of
the ZeRO-3 optimizer, attributes ZeRO-3 adds to parameters, the fp16 optimizers' groups, checkpoint file names and
the universal-checkpoint converter's command line. A release that renamed or reshaped one of them would make a patch
silently do nothing (say, an assignment to a method that no longer exists) or fail deep inside a run, so each
patch's check verifies that its internals have the shape the code here expects (the attribute exists, is callable,
takes the parameters it is called with, reads the names it is patched around) on a release it was checked against.

Patches come in three classes (docs/deepspeed_patches.md says what each replaces and why):
- correctness (work-arounds for DeepSpeed bugs, and the internals the engine reads): always on. `parallelize` runs
  the checks of those the run needs (`needed`) first; a changed internal stops the launch with one line naming the
  patch, what changed, the installed version and the pin, since a run without the patch would train or save
  wrongly. On a release they were not checked against, those whose change would be silent (`stops_unchecked`: the
  ZeRO-3 initialisation and the fp16 loss scale and masters) stop the launch the same way; the others warn once and
  are applied when their check passes, since a change in what they rely on would show at once.
- memory and speed: applied only when their engine setting asks (`SETTINGS`), and only through `applies()`, which
  on an unchecked release or a failed check warns once and skips the patch: the run is the same without them.

Patches (`PATCHES`, by name):
    zero3_param_attributes     ZeRO-3 parameters' ds_id / ds_tensor / ds_numel / ds_shape / ds_status
    zero_init_apply            deepspeed.zero.Init gathers a module's own weights around `Module.apply`
    fp32_master_shared         Stage3._create_fp32_partitions, patched while the optimizer is built
    zero12_master_shared       DeepSpeedZeroOptimizer's fp32 master partitions, replaced by views of the parameters
    skip_identity_grad_passes  Stage3._get_norm_groups / unscale_and_clip_grads, replaced on one optimizer
    single_rank_no_allreduce   DeepSpeedEngine.enable_backward_allreduce, cleared on a one-rank ZeRO-0 engine
    zero0_fp16_loss_scale      engine.backward leaves the loss unscaled at ZeRO-0 fp16; the wrappers' loss_scale
    zero0_fp16_masters         the ZeRO-0 fp16 optimizer's fp16_groups / fp32_groups, in memory and in checkpoints
    fp16_skipped_steps         DeepSpeedEngine.skipped_steps counts the fp16 steps an overflow skipped, checkpointed
    checkpoint_files           mp_rank_00_model_states.pt, zero_pp_rank_* shards, ds_to_universal's flags
    checkpoint_writes          every file of a tag is written through engine.checkpoint_engine.save, recorded

DeepSpeed is imported inside the functions, as elsewhere in the engine: importing it takes seconds.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch
from torch import nn

from core.compat.checks import CompatError, Library, code_words

log = logging.getLogger(__name__)

WRITTEN_FOR = "0.19"
"""The DeepSpeed release series the patches were written and checked against (pyproject's pin covers exactly it)."""


class DeepSpeedCompatError(CompatError):
    """The installed DeepSpeed no longer has an internal that a patch in this module relies on."""


DEEPSPEED = Library("DeepSpeed", "deepspeed", __name__, WRITTEN_FOR, "deepspeed>=0.19,<0.20", DeepSpeedCompatError)

PatchClass = Literal["correctness", "memory", "speed"]


@dataclass(frozen=True)
class Patch:
    """One reliance on DeepSpeed internals: `check()` raises DeepSpeedCompatError when the internal has changed, or
    when the installed release is not one it was checked against and the patch cannot be trusted there."""

    name: str
    kind: PatchClass
    verify: Callable[[str], None]
    """Checks the internals the patch relies on; called with the patch's name, for the error."""
    stops_unchecked: bool = True
    """On a release it was not checked against: stop (memory and speed patches are then skipped by `applies`), or
    (False) warn once and apply it when its check passes: correctness patches whose change would show loudly."""

    def check(self) -> None:
        checked = DEEPSPEED.is_checked()
        if not checked and self.stops_unchecked:
            DEEPSPEED.check_version(self.name)
        self.verify(self.name)
        if not checked:
            version = DEEPSPEED.version()
            why = f"checked on DeepSpeed {WRITTEN_FOR}.x, not deepspeed {version}; its check passed, so it is applied"
            _warn_once(self.name, f"DeepSpeed patch {self.name!r} was {why}.")


_warned: set[str] = set()
"""The patches already warned about in this process."""


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("%s", message)


def _skip(name: str, why: str) -> bool:
    """Warn, once per process and in one line, that the optional patch `name` is skipped and why; False."""
    _warn_once(name, f"{why} Skipped: the run goes on without it (engine.{SETTINGS[name]}).")
    return False


def applies(name: str) -> bool:
    """Whether the memory or speed patch `name`, which its engine setting asked for, can be applied: its check
    passes on a release it was checked against. Otherwise it is skipped with a warning (once per process), since the
    run is the same without it."""
    assert PATCHES[name].kind != "correctness", f"{name} is always applied"
    try:
        PATCHES[name].check()
    except DeepSpeedCompatError as err:
        return _skip(name, str(err))
    return True


def _stage3(patch: str) -> type:
    return DEEPSPEED.attr(
        patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.zero.stage3"), "DeepSpeedZeroOptimizer_Stage3"
    )


def _engine_class(patch: str) -> type:
    return DEEPSPEED.attr(patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.engine"), "DeepSpeedEngine")


# zero3_param_attributes: what ZeRO-3 adds to each parameter it converts.


def is_zero3_param(param: torch.Tensor) -> bool:
    """True when ZeRO-3 has converted `param` (partitioned it over the ranks)."""
    return hasattr(param, "ds_id")


def is_partitioned(module: nn.Module) -> bool:
    """True when ZeRO-3 has converted `module`'s parameters."""
    return any(is_zero3_param(p) for p in module.parameters())


def partition_sizes(module: nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, elements of the full parameters) of a ZeRO-3 partitioned `module`."""
    params = list(module.parameters())
    return sum(p.ds_tensor.numel() for p in params), sum(p.ds_numel for p in params)


def partition_report(module: nn.Module) -> str:
    """How much of `module`'s parameters this rank holds, e.g. 'this rank holds 1,234 of 2,468 parameters (50.0%)'."""
    held, total = partition_sizes(module)
    return f"this rank holds {held:,} of {total:,} parameters ({100 * held / total:.1f}%)"


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter, also when ZeRO-3 holds only this rank's partition in `param`."""
    return param.ds_shape if is_zero3_param(param) else param.shape


def is_released(param: torch.Tensor) -> bool:
    """True when ZeRO-3 has released `param`'s gathered values (only the rank's partition is left)."""
    return getattr(getattr(param, "ds_status", None), "name", None) == "NOT_AVAILABLE"


def _check_zero3_param_attributes(patch: str) -> None:
    partitioning = DEEPSPEED.module_named(patch, "deepspeed.runtime.zero.partition_parameters")
    attributes = ("ds_id", "ds_tensor", "ds_numel", "ds_shape", "ds_status")
    DEEPSPEED.method(patch, DEEPSPEED.attr(patch, partitioning, "Init"), "_convert_to_deepspeed_param", uses=attributes)
    DEEPSPEED.attr(patch, DEEPSPEED.attr(patch, partitioning, "ZeroParamStatus"), "NOT_AVAILABLE")


# zero_init_apply: objectives initialise their weights module by module through `Module.apply`; inside
# deepspeed.zero.Init (config key `override_module_apply`, which `deepspeed_config` sets) each call gathers the
# module's own partitioned parameters, runs the function and scatters rank 0's values back.


def _check_zero_init_apply(patch: str) -> None:
    partitioning = DEEPSPEED.module_named(patch, "deepspeed.runtime.zero.partition_parameters")
    DEEPSPEED.attr(patch, DEEPSPEED.attr(patch, partitioning, "Init"), "override_module_apply")
    zero_config = DEEPSPEED.attr(
        patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.zero.config"), "DeepSpeedZeroConfig"
    )
    if "override_module_apply" not in zero_config.model_fields:
        DEEPSPEED.fail(patch, "the ZeRO config has no override_module_apply key")
    context = DEEPSPEED.attr(patch, partitioning, "InsertPostInitMethodToModuleSubClasses")
    DEEPSPEED.method(
        patch, context, "patch_init_and_builtins", uses=("override_module_apply", "all_gather", "partition")
    )


# fp32_master_shared


@contextlib.contextmanager
def fp32_master_shared():
    """While DeepSpeed sets up its ZeRO-3 optimizer, let it use fp32 parameter partitions as their own master weights.

    DeepSpeed 0.19 means to skip the master copy when the partitions are already fp32 on the optimizer's device (our
    bf16 is autocast over fp32 weights), but it compares a `torch.device` with the device's *name*, a string, which is
    never equal. So it keeps a second fp32 copy: 4 bytes per parameter per rank, 0.6 GiB for MAE ViT-L on 2 ranks
    (`make bench-memory`). Inside this block the name is a `torch.device` while the master partitions are created.
    Partitions offloaded to the CPU or kept in fp16 still get their own master copy, as DeepSpeed intends.
    """
    stage3 = _stage3("fp32_master_shared")
    create = stage3._create_fp32_partitions

    def create_sharing(self) -> None:
        name = self.device
        self.device = torch.device(name)
        try:
            create(self)
        finally:
            self.device = name

    stage3._create_fp32_partitions = create_sharing
    try:
        yield
    finally:
        stage3._create_fp32_partitions = create


def _check_fp32_master_shared(patch: str) -> None:
    groups = ("device", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat")
    DEEPSPEED.method(patch, _stage3(patch), "_create_fp32_partitions", params=("self",), uses=groups)


# zero12_master_shared


def share_zero12_masters(zero) -> bool:
    """Let `zero`, a DeepSpeed ZeRO-1/2 optimizer just built, step its rank's partition of the fp32 parameters itself
    instead of a copy of it.

    DeepSpeed 0.19's ZeRO-1/2 optimizer always clones its rank's partition of the flat parameter buffer into an fp32
    master partition, steps the clone, then copies it back into the parameters after every step. Our bf16 is autocast
    over fp32 weights, so with bf16 and fp32 the parameters already are fp32 on the optimizer's device: the clone costs
    4 bytes per parameter per rank (0.45 GB for MAE ViT-B on one rank) and the copy back a pass over the partition
    on every step. Here, before the first step, the master partition becomes a view of the parameters' own storage
    where it is held: DeepSpeed's list, the torch optimizer's group, and the links that `safe_get_full_fp32_param` and
    universal checkpoints read (rebuilt). The clone is freed, and the copy back is then a copy of a tensor onto
    itself, which torch skips. Checkpoints are unchanged: the same values are saved under the same keys.

    Returns:
        Whether the masters are now shared: not with CPU offload or fp16 weights, which need a master copy, nor
        when DeepSpeed's masters are not what the patch expects (then it warns once and changes nothing).
    """
    if zero.cpu_offload or any(g.dtype != torch.float32 for g in zero.bit16_groups_flat):
        return False
    import deepspeed.comm as dist

    ranks = [dist.get_rank(group=group) for group in zero.real_dp_process_group]
    owns = [partitions[rank] for partitions, rank in zip(zero.parallel_partitioned_bit16_groups, ranks, strict=True)]
    for own, master in zip(owns, zero.single_partition_of_fp32_groups, strict=True):
        if master.device != own.device or zero.optimizer.state.get(master) or not torch.equal(master, own):
            why = "a master partition is not an unstepped copy of the parameters' partition"
            return _skip("zero12_master_shared", f"DeepSpeed patch 'zero12_master_shared': {why}.")
    for i, (group, own) in enumerate(zip(zero.optimizer.param_groups, owns, strict=True)):
        shared = own.detach()
        shared.requires_grad = True
        zero.single_partition_of_fp32_groups[i] = shared
        group["params"] = [shared]
    zero._link_all_hp_params()
    zero._param_slice_mappings = zero._create_param_mapping()
    return True


def _check_zero12_master_shared(patch: str) -> None:
    zero = DEEPSPEED.attr(
        patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.zero.stage_1_and_2"), "DeepSpeedZeroOptimizer"
    )
    lists = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "bit16_groups_flat")
    DEEPSPEED.method(
        patch, zero, "__init__", uses=(*lists, "cpu_offload", "real_dp_process_group", "_param_slice_mappings")
    )
    # the step copies the master back into the parameters, and the links are rebuilt from DeepSpeed's list
    DEEPSPEED.method(patch, zero, "step", uses=lists[:2])
    DEEPSPEED.method(patch, zero, "_link_all_hp_params", params=("self",), uses=(lists[0],))
    DEEPSPEED.method(patch, zero, "_create_param_mapping", params=("self",))


# skip_identity_grad_passes


def skip_identity_grad_passes(zero3) -> bool:
    """Drop the global gradient norm and the unscale from the steps of `zero3` (a DeepSpeed ZeRO-3 optimizer) when
    gradients are neither clipped nor loss-scaled (bf16 and fp32 with `optim.grad_clip` 0).

    DeepSpeed needs the norm only to clip and to catch fp16 overflow, and the unscale then multiplies every gradient
    by 1. The loop measures the norm itself on logging steps (`Guarded.measure`), as at ZeRO-1/2, where DeepSpeed's
    `compute_grad_norm: false` drops it (DeepSpeed refuses that key at ZeRO-3).

    Returns:
        Whether they were dropped: False with gradient clipping or a loss scale other than a fixed 1 (fp16).
    """
    if zero3.clip_grad > 0 or zero3.dynamic_loss_scale or zero3.loss_scale != 1.0:
        return False
    device = zero3.fp32_partitioned_groups_flat[0].device

    def no_norm() -> list[torch.Tensor]:
        return [torch.zeros((), device=device)]

    def no_unscale(sub_group_id: int, total_norm: torch.Tensor) -> None:
        return None

    zero3._get_norm_groups = no_norm
    zero3.unscale_and_clip_grads = no_unscale
    return True


def _check_skip_identity_grad_passes(patch: str) -> None:
    stage3 = _stage3(patch)
    # `step` must look both up on the instance, and combine the norm groups the replacement returns.
    DEEPSPEED.method(
        patch, stage3, "step", uses=("_get_norm_groups", "combine_grad_norm_groups", "unscale_and_clip_grads")
    )
    DEEPSPEED.method(patch, stage3, "_get_norm_groups", params=("self",))
    DEEPSPEED.method(patch, stage3, "unscale_and_clip_grads", params=("self", "sub_group_id", "total_norm"))
    DEEPSPEED.method(
        patch, stage3, "__init__", uses=("clip_grad", "dynamic_loss_scale", "fp32_partitioned_groups_flat")
    )
    DEEPSPEED.attr(patch, stage3, "loss_scale")


# single_rank_no_allreduce


def skip_single_rank_allreduce(engine) -> bool:
    """Drop the gradient all-reduce from the backward passes of `engine` when it is a ZeRO-0 engine of one rank.

    At ZeRO-0 DeepSpeed's backward flattens every gradient into buckets, divides them by the world size, all-reduces
    them and copies them back into the parameters' `.grad`: with one rank that is the identity, paid on every step
    (three passes over the gradients and a collective; on the quickstart model it is a fixed cost per step that the
    arithmetic does not amortise). ZeRO-1/2 must keep it: their reduction is also what moves the gradients into their
    partitions.

    Returns:
        Whether it was dropped: only at ZeRO-0 with a data-parallel world size of 1.
    """
    if engine.zero_optimization_stage() != 0 or engine.dp_world_size != 1:
        return False
    engine.enable_backward_allreduce = False
    return True


def _check_single_rank_no_allreduce(patch: str) -> None:
    engine = _engine_class(patch)
    # The flag must be the one test in front of the reduction, after backward and at a manual accumulation boundary.
    DEEPSPEED.method(patch, engine, "_backward_epilogue", uses=("enable_backward_allreduce", "allreduce_gradients"))
    DEEPSPEED.method(patch, engine, "step", uses=("enable_backward_allreduce", "allreduce_gradients"))
    DEEPSPEED.method(patch, engine, "__init__", uses=("enable_backward_allreduce",))
    DEEPSPEED.method(patch, engine, "_configure_distributed_model", uses=("dp_world_size",))


# zero0_fp16_loss_scale: at ZeRO-0, DeepSpeed 0.19's `engine.backward` does not multiply the loss by the loss scale
# (only ZeRO optimizers get it; deepspeedai/DeepSpeed PR #8393), yet its fp16 optimizer divides the gradients by that
# scale before the update. The loop scales the loss itself there; a release that fixes it would scale twice.

_FP16_WRAPPERS = (  # (module, class) of each optimizer wrapper an fp16 engine may have
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
)


def scales_loss_itself(engine) -> bool:
    """Whether the loop must multiply the loss by the loss scale before `engine.backward` (fp16 at ZeRO-0)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    return engine.fp16_enabled() and not isinstance(engine.optimizer, ZeROOptimizer)


def loss_scale(engine):
    """The current loss scale of an fp16 engine's optimizer (every DeepSpeed fp16 wrapper has one), as it keeps it."""
    return engine.optimizer.loss_scale


def _check_zero0_fp16_loss_scale(patch: str) -> None:
    # engine.backward and `scales_loss_itself` must tell the optimizers apart by the same test, and only by it.
    DEEPSPEED.attr(patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.base_optimizer"), "ZeROOptimizer")
    backward = DEEPSPEED.method(patch, _engine_class(patch), "backward", uses=("ZeROOptimizer", "scale_if_loss"))
    if "fp16_enabled" in code_words(backward)[0]:
        DEEPSPEED.fail(
            patch, "DeepSpeedEngine.backward now scales fp16 losses itself (PR #8393?): the loop would scale twice"
        )
    for module, name in _FP16_WRAPPERS:
        DEEPSPEED.attr(patch, DEEPSPEED.attr(patch, DEEPSPEED.module_named(patch, module), name), "loss_scale")


# fp16_skipped_steps: DeepSpeed counts the optimizer steps a gradient overflow skipped (fp16) on the engine, and
# saves and restores the count with each checkpoint; the loop logs it as train/skipped_steps.


def skipped_steps(engine) -> int:
    """How many optimizer steps an fp16 engine has skipped on gradient overflow in the run, resumes included."""
    return engine.skipped_steps


def _check_fp16_skipped_steps(patch: str) -> None:
    engine = _engine_class(patch)
    DEEPSPEED.method(patch, engine, "__init__", uses=("skipped_steps",))
    DEEPSPEED.method(patch, engine, "_take_model_step", uses=("skipped_steps", "overflow"))
    DEEPSPEED.method(patch, engine, "_common_checkpoint_state", uses=("skipped_steps",))
    DEEPSPEED.method(patch, engine, "_load_checkpoint", strings=("skipped_steps",))


# zero0_fp16_masters: at ZeRO-0 the fp16 optimizer (the unfused one, which wraps any torch optimizer) keeps the fp32
# master weights as lists of tensors, group by group beside the fp16 parameters, and saves them in its state dict.

_MASTERS_KEY = "fp32_groups"


def zero0_groups(engine) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """(fp16 groups, fp32 groups) of a ZeRO-0 fp16 engine's optimizer: the parameters it computes with and their fp32
    master weights, tensor for tensor."""
    return engine.optimizer.fp16_groups, engine.optimizer.fp32_groups


def checkpoint_fp32_groups(states: dict) -> list[list[torch.Tensor]] | None:
    """The fp32 master weights, group by group, in the model states of a ZeRO-0 checkpoint; None unless fp16 saved
    them."""
    return (states.get("optimizer") or {}).get(_MASTERS_KEY)


def _check_zero0_fp16_masters(patch: str) -> None:
    unfused = DEEPSPEED.attr(
        patch, DEEPSPEED.module_named(patch, "deepspeed.runtime.fp16.unfused_optimizer"), "FP16_UnfusedOptimizer"
    )
    DEEPSPEED.method(patch, unfused, "__init__", uses=("fp16_groups", _MASTERS_KEY))
    DEEPSPEED.method(patch, unfused, "state_dict", strings=(_MASTERS_KEY,))
    DEEPSPEED.method(patch, _engine_class(patch), "_configure_fp16_optimizer", uses=("FP16_UnfusedOptimizer",))
    DEEPSPEED.method(patch, _engine_class(patch), "_common_checkpoint_state", strings=("module", "optimizer"))


# checkpoint_files: what DeepSpeed names the files of a checkpoint tag, and the converter to a universal checkpoint.

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
"""The model states of a ZeRO-0/1/2 checkpoint tag: the whole module ("module") and, at ZeRO-0, the optimizer."""
ZERO_SHARD_PATTERN = "*zero_pp_rank_*"
"""The files of a tag that hold ZeRO partitions (optimizer shards; at ZeRO-3 the model's as well)."""
_UNIVERSAL_FLAGS = ("--input_folder", "--output_folder", "--num_extract_workers", "--num_merge_workers")
_UNIVERSAL_MODULE = "deepspeed.checkpoint.ds_to_universal"


def has_zero_shards(tag_dir: Path) -> bool:
    """Whether the checkpoint tag holds ZeRO partitions, which only the world size that wrote them loads directly."""
    return any(tag_dir.glob(ZERO_SHARD_PATTERN))


def universal_command(tag_dir: Path, out_dir: Path) -> list[str]:
    """The command that converts the ZeRO checkpoint `tag_dir` into a universal checkpoint in `out_dir` (one worker
    each, with optimizer state DeepSpeed leaves out filled in)."""
    command = [sys.executable, "-m", _UNIVERSAL_MODULE, "--input_folder", str(tag_dir), "--output_folder", str(out_dir)]
    return [*command, "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]


def _check_checkpoint_files(patch: str) -> None:
    engine = _engine_class(patch)
    stand_in = SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: False)
    try:  # DeepSpeed's own naming, run on a stand-in engine of one ZeRO-0/1/2 rank
        model_states = Path(DEEPSPEED.method(patch, engine, "_get_ckpt_name")(stand_in, "ckpt", "tag")).name
        shard = (
            DEEPSPEED.method(patch, engine, "_get_zero_ckpt_prefix")(stand_in, 0, bf16_mode=False) + "_optim_states.pt"
        )
    except Exception as err:  # noqa: BLE001 - any failure means the naming code changed
        DEEPSPEED.fail(patch, f"DeepSpeedEngine's checkpoint file naming failed on a stand-in engine ({err!r})")
    if model_states != MODEL_STATES_FILE:
        DEEPSPEED.fail(patch, f"model states are saved as {model_states}, not {MODEL_STATES_FILE}")
    if not fnmatch.fnmatch(shard, ZERO_SHARD_PATTERN):
        DEEPSPEED.fail(patch, f"ZeRO shards are saved as {shard}, which {ZERO_SHARD_PATTERN} does not match")
    converter = DEEPSPEED.module_named(patch, _UNIVERSAL_MODULE)
    DEEPSPEED.method(patch, converter, "main")
    DEEPSPEED.method(patch, converter, "parse_arguments", strings=(*_UNIVERSAL_FLAGS, "--inject_missing_state"))


# checkpoint_writes: DeepSpeed writes every file of a tag through `engine.checkpoint_engine.save(state_dict, path)`
# (the model states, each rank's ZeRO shards); the recovery scripts it copies beside them are not needed to resume.


@contextlib.contextmanager
def recorded_writes(engine, written: dict[str, int], errors: list[OSError]):
    """While the block runs, every file `engine` saves is fsynced and recorded in `written` ({name: bytes}); a write
    that fails with an OSError (a full disk) is recorded in `errors` instead of raised, so that DeepSpeed goes on
    through the collectives of its save (a rank that raised would leave the others waiting at its barriers)."""
    ckpt_engine = engine.checkpoint_engine
    save = ckpt_engine.save

    def save_recorded(state_dict, path: str) -> None:
        try:
            save(state_dict, path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            written[Path(path).name] = os.path.getsize(path)
        except OSError as err:
            errors.append(err)

    ckpt_engine.save = save_recorded
    try:
        yield
    finally:
        del ckpt_engine.save  # the class's method again


def _check_checkpoint_writes(patch: str) -> None:
    engine = _engine_class(patch)
    DEEPSPEED.method(patch, engine, "_save_checkpoint", uses=("checkpoint_engine", "save"))
    DEEPSPEED.method(patch, engine, "_save_zero_checkpoint", uses=("checkpoint_engine", "save"))
    torch_engine = DEEPSPEED.module_named(patch, "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine")
    DEEPSPEED.method(
        patch,
        DEEPSPEED.attr(patch, torch_engine, "TorchCheckpointEngine"),
        "save",
        params=("self", "state_dict", "path"),
    )


PATCHES: dict[str, Patch] = {
    patch.name: patch
    for patch in (
        Patch("zero3_param_attributes", "correctness", _check_zero3_param_attributes, stops_unchecked=False),
        Patch("zero_init_apply", "correctness", _check_zero_init_apply),
        Patch("fp32_master_shared", "memory", _check_fp32_master_shared),
        Patch("zero12_master_shared", "memory", _check_zero12_master_shared),
        Patch("skip_identity_grad_passes", "speed", _check_skip_identity_grad_passes),
        Patch("single_rank_no_allreduce", "speed", _check_single_rank_no_allreduce),
        Patch("zero0_fp16_loss_scale", "correctness", _check_zero0_fp16_loss_scale),
        Patch("zero0_fp16_masters", "correctness", _check_zero0_fp16_masters),
        Patch("fp16_skipped_steps", "correctness", _check_fp16_skipped_steps, stops_unchecked=False),
        Patch("checkpoint_files", "correctness", _check_checkpoint_files, stops_unchecked=False),
        Patch("checkpoint_writes", "correctness", _check_checkpoint_writes, stops_unchecked=False),
    )
}

SETTINGS = {
    "fp32_master_shared": "share_zero3_masters",
    "zero12_master_shared": "share_zero12_masters",
    "skip_identity_grad_passes": "skip_identity_grad_passes",
    "single_rank_no_allreduce": "skip_single_rank_allreduce",
}
"""The engine setting (`engine.<name>` in a recipe) that turns each memory and speed patch on."""


def needed(zero_stage: int, precision: str) -> tuple[str, ...]:
    """The correctness patches a run at `zero_stage` in `precision` relies on."""
    names = ["checkpoint_files", "checkpoint_writes"]
    if zero_stage == 3:
        names += ["zero3_param_attributes", "zero_init_apply"]
    if precision == "fp16":
        names += ["zero0_fp16_loss_scale", "zero0_fp16_masters", "fp16_skipped_steps"]
    return tuple(names)


def check(*names: str) -> None:
    """Run the checks of the named patches (default: every correctness patch); raises DeepSpeedCompatError at the
    first that fails."""
    for name in names or (name for name, patch in PATCHES.items() if patch.kind == "correctness"):
        PATCHES[name].check()
