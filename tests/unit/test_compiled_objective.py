"""`engine.compile_scope: objective`: the objective's whole training step in one graph (core/engine/compiled.py
`compile_objective`), counted through a torch.compile backend that runs graphs as AOT autograd traced them: one
forward and one backward graph, no graph break, for MAE, BEiT-style, SimMIM, data2vec 2.0 (its EMA teacher's pass
inside, under no_grad), I-JEPA (its multi-block masks travel as batch tensors) and classification; the same losses and
gradients as eager; eager at any other batch, in evaluation and in deep copies; DeepSpeed's module hooks outside the
graph (through `parallelize`); and `engine.compile: auto`."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from core.engine import compiled as compiled_module
from core.engine.compiled import (
    CompiledForward,
    compile_blocks,
    compile_objective,
    compiles,
    describe_compiled,
    use_compile_cache,
)
from core.engine.setup import parallelize
from core.recipe.config import ConfigError, load_config
from core.recipe.teacher_sections import ConvDecoderConfig, EMASchedule, PredictorConfig
from data.masking import InverseBlockMaskGenerator, MaskStack
from data.multiblock import MultiBlockMasks
from pretrain.data2vec2 import Data2Vec2
from pretrain.ijepa import IJEPA
from tests.helpers.models import tiny_vit
from tests.unit.test_compiled import OBJECTIVES, GraphCounter, _images, _mae, _train_step

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _data2vec2() -> Data2Vec2:
    decoder = ConvDecoderConfig(embed_dim=16, groups=4, num_layers=2)
    return Data2Vec2(tiny_vit(0).train(), tiny_vit(1), ema=EMASchedule(), decoder=decoder, top_k_blocks=2, num_masked=8)


def _copies(batch: int, num_masks: int = 2) -> torch.Tensor:
    """(B, M, 4, 4) inverse block masks as the data workers make them: 8 of 16 tokens masked in every copy."""
    masks, rng = MaskStack(InverseBlockMaskGenerator((4, 4), 0.5, block_size=2), num_masks), random.Random(batch)
    return torch.stack([masks(rng) for _ in range(batch)])


def _ijepa() -> IJEPA:
    encoder, teacher = (tiny_vit(seed, class_token=False, global_pool="avg") for seed in (0, 1))
    predictor = PredictorConfig(depth=2, embed_dim=16, num_heads=2)
    return IJEPA(encoder.train(), teacher, ema=EMASchedule(), predictor=predictor)


def _multiblock(batch: int) -> dict[str, torch.Tensor]:
    """The masks the data workers draw for a batch: "context_ids" (B, Nc) and "target_ids" (B, 2, 4), two 2 x 2
    target blocks per image."""
    masks = MultiBlockMasks((4, 4), num_targets=2, target_scale=(0.25, 0.25), target_aspect=(1.0, 1.0), min_keep=4)
    return masks.draw(batch, random.Random(batch))


BUILDS = {
    "mae": (_mae, lambda b: {"image": _images(b)}),
    "data2vec2": (_data2vec2, lambda b: {"image": _images(b), "mask": _copies(b)}),
    "ijepa": (_ijepa, lambda b: {"image": _images(b), **_multiblock(b)}),
    **OBJECTIVES,
}


def _steps(objective, batch, seeds=range(STEPS)) -> torch.Tensor:
    losses = []
    for seed in seeds:
        torch.manual_seed(seed)  # the same masks (MAE draws them inside the graph) in both runs
        losses.append(_train_step(objective, {**batch(8), "num_corrupt": 0, "positions": ["a", "b"]}))
    return torch.stack(losses)


@pytest.mark.parametrize("kind", sorted(BUILDS))
def test_the_whole_step_is_one_graph_with_no_break_and_eager_losses_and_gradients(kind):
    build, batch = BUILDS[kind]
    eager, compiled, counter = build(), build(), GraphCounter()
    compile_blocks(compiled, {8, 16}, backend=counter)  # the blocks at the eval sizes too, as parallelize does
    compile_objective(compiled, 8, backend=counter)
    want, got = _steps(eager, batch), _steps(compiled, batch)
    # one forward graph and its backward for the whole step; the blocks inside it traced into the same graph
    assert (counter.graphs, counter.backward_graphs, counter.calls) == (1, 1, STEPS)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_data2vec2s_teacher_runs_inside_the_one_graph_under_no_grad():
    """The teacher's pass (once per image, B rows) is traced into the step's one graph between a switch of grad mode
    off and on, not run eagerly beside it."""
    counter, inputs, grad_modes = GraphCounter(), [], []

    def backend(gm, example_inputs):
        inputs.extend(node.target for node in gm.graph.nodes if node.op == "placeholder")
        grad_modes.extend(node.args for node in gm.graph.nodes if node.target is torch._C._set_grad_enabled)
        return counter(gm, example_inputs)

    objective = _data2vec2()
    compile_objective(objective, 8, backend=backend)
    out = objective({"image": _images(8), "mask": _copies(8)})
    out["loss"].backward()
    assert (counter.graphs, counter.backward_graphs, counter.calls) == (1, 1, 1)
    assert dict(counters["graph_break"]) == {}
    assert grad_modes == [(False,), (True,)]  # the teacher's `with torch.no_grad()`, inside the graph
    teacher_inputs = [name for name in inputs if "_modules_teacher_" in name]
    assert any("patch_embed" in name for name in teacher_inputs)
    assert any("blocks_modules_1_" in name for name in teacher_inputs)  # its top block, the target's
    assert all(p.grad is None for p in objective.teacher.parameters())


def test_other_batches_evaluation_and_copies_run_eagerly_and_names_stay():
    objective, counter = _mae(), GraphCounter()
    names = [name for name, _ in objective.named_parameters()]
    compile_objective(objective, 8, backend=counter)
    _train_step(objective, {"image": _images(8)})
    assert isinstance(objective.forward, CompiledForward) and counter.calls == 1
    _train_step(objective, {"image": _images(4)})  # another batch size: eager, nothing compiled
    with torch.no_grad():
        objective({"image": _images(8)})  # no gradients (the pictures' batch): eager
    objective.eval()
    objective({"image": _images(8)})
    objective.train()
    assert (counter.graphs, counter.calls) == (1, 1)
    twin = copy.deepcopy(objective)  # the FLOP counter's twin, an EMA
    assert twin.forward.__func__ is type(objective).forward and twin.forward.__self__ is twin
    _train_step(twin, {"image": _images(8)})
    assert counter.calls == 1  # the copy ran its own eager forward
    assert [name for name, _ in objective.named_parameters()] == names and "_orig_mod" not in str(names)
    assert describe_compiled(objective) == "the objective's step at batch 8"


def test_activation_checkpointing_inside_the_compiled_step_recomputes_with_eager_losses():
    runs, counter = [], GraphCounter()
    for compile_it in (False, True):
        objective = _mae(depth=2)
        objective.encoder.set_grad_checkpointing(True)  # engine.activation_checkpointing
        if compile_it:
            compile_objective(objective, 8, backend=counter)
        runs.append(_steps(objective, BUILDS["mae"][1]))
    assert counter.graphs == 1 and dict(counters["graph_break"]) == {}
    torch.testing.assert_close(runs[1], runs[0], atol=1e-5, rtol=1e-5)


def test_through_deepspeed_the_hooks_stay_outside_the_one_graph(one_rank, tmp_path: Path, monkeypatch):
    counter = GraphCounter()
    monkeypatch.setattr(compiled_module, "_compiled", lambda fn, backend, mode: torch.compile(fn, backend=counter))
    monkeypatch.setenv("MIMPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    losses = {}
    for setting in ("false", "true"):
        cfg = load_config(None, [f"run_dir={tmp_path}", f"engine.compile={setting}", "data.global_batch_size=8"])
        torch.manual_seed(0)
        engine, optimizer = parallelize(_mae(), cfg=cfg, dist=one_rank, run_dir=tmp_path)
        losses[setting] = []
        for seed in range(STEPS):
            torch.manual_seed(seed)
            loss = engine({"image": _images(8, seed)})["loss"]
            engine.backward(loss)
            with optimizer.guard(skip=False):
                engine.step()
            losses[setting].append(loss.detach())
    assert (counter.graphs, counter.backward_graphs, counter.calls) == (1, 1, STEPS)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(torch.stack(losses["true"]), torch.stack(losses["false"]), atol=1e-5, rtol=1e-5)
    assert use_compile_cache() == str(tmp_path / "cache" / "inductor")  # where parallelize pointed inductor
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")  # a folder the user chose is kept


def test_auto_compiles_on_cuda_but_at_zero3_and_never_on_a_cpu():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = load_config(None, [])
    assert auto.engine.compile == "auto" and compiles(auto, cuda) and not compiles(auto, cpu)
    assert not compiles(load_config(None, ["engine.zero_stage=3"]), cuda)  # auto at ZeRO-3: eager
    assert compiles(load_config(None, ["engine.compile=true"]), cpu)
    assert not compiles(load_config(None, ["engine.compile=false"]), cuda)
    with pytest.raises(ConfigError, match="engine.compile does not work with engine.zero_stage 3"):
        load_config(None, ["engine.compile=true", "engine.zero_stage=3"])
    with pytest.raises(ConfigError, match="compile_mode"):
        load_config(None, ["engine.compile_mode=fast"])
