"""`engine.compile`: per-block torch.compile of the objectives, compiled once per block shape, same losses as eager."""

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from core.engine.compiled import BlockCall, DropPathRate, compile_batch_sizes, compile_blocks, describe_compiled
from core.recipe.config import ZERO3_COMPILE_REASON, ConfigError, load_config
from finetune.classification import Classification
from pretrain.beit import MaskedPatchPrediction
from pretrain.knn import pooled_features
from pretrain.mae import MAE
from pretrain.simmim import SimMIM
from pretrain.targets import MeanColor3Bit
from tests.helpers.models import tiny_vit


class GraphCounter:
    """A torch.compile backend that runs graphs as AOT autograd traced them (forward and backward), counting each
    forward graph compiled: a recompilation, or a graph break inside a block, shows as an extra graph."""

    def __init__(self):
        self.graphs = 0
        self.backward_graphs = 0
        self.calls = 0  # forward graphs run: a block that fell back to eager runs none

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return aot_autograd(fw_compiler=self._forward, bw_compiler=self._backward)(gm, example_inputs)

    def _forward(self, gm, example_inputs):
        graph = make_boxed_func(gm)

        def counted(args):
            self.calls += 1
            return graph(args)

        counted._boxed_call = True
        return counted

    def _backward(self, gm, example_inputs):
        self.backward_graphs += 1
        return make_boxed_func(gm)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mae(depth: int = 4, seed: int = 0) -> MAE:
    encoder = tiny_vit(seed, depth=depth).train()
    return MAE(encoder, decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2)


def _images(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))  # (B, 3, 16, 16)


def _train_step(objective, batch: dict) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = objective(batch)["loss"]
    loss.backward()
    return loss.detach()


def test_repeated_blocks_compile_once_and_mae_training_never_recompiles():
    objective, counter = _mae(depth=4), GraphCounter()
    assert compile_blocks(objective, {8}, backend=counter) == 6  # 4 encoder blocks + 2 decoder blocks
    _train_step(objective, {"image": _images(8)})
    # one graph for all 4 encoder blocks (B, 1 + 4 visible, 32), one for both decoder blocks (B, 1 + 16, 32)
    assert (counter.graphs, counter.backward_graphs) == (2, 2)
    for seed in range(2, 6):  # new random masks every step: the same number of visible tokens, the same shapes
        _train_step(objective, {"image": _images(8, seed)})
    assert (counter.graphs, counter.backward_graphs) == (2, 2)


def test_evaluation_compiles_once_and_other_batch_sizes_run_eagerly():
    objective, counter = _mae(depth=2), GraphCounter()
    reference = copy.deepcopy(objective).eval()  # a deep copy runs eagerly
    compile_blocks(objective, {8, 16}, backend=counter)
    _train_step(objective, {"image": _images(8)})
    objective.eval()
    # the kNN monitor's passes: full batches of 16, then the last partial batch of 5 and a rank's stand-in of 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch, seed in [(16, 1), (16, 2), (5, 3), (1, 4), (16, 5)]:
            got = pooled_features(objective.encoder, _images(batch, seed), "cls")
            want = pooled_features(reference.encoder, _images(batch, seed), "cls")
            if batch < 16:  # eager: exactly the reference
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert counter.graphs == 3  # training's two + evaluation's one: 5 and 1 ran eagerly, 16 compiled once
    objective.train()
    _train_step(objective, {"image": _images(8, 6)})  # back to training: its graphs are still there
    assert counter.graphs == 3


def test_activation_checkpointing_recomputes_the_compiled_blocks_with_eager_losses():
    runs, counter = [], GraphCounter()
    for compiled in (False, True):
        torch.manual_seed(0)
        objective = _mae(depth=2)
        objective.encoder.set_grad_checkpointing(True)  # engine.activation_checkpointing
        if compiled:
            compile_blocks(objective, {8}, backend=counter)
        losses = []
        for seed in range(3):
            torch.manual_seed(seed)  # the same masks in both
            losses.append(_train_step(objective, {"image": _images(8, seed)}))
        runs.append((objective, torch.stack(losses)))
    (eager, want), (compiled, got) = runs
    assert (counter.graphs, counter.backward_graphs) == (2, 2)  # the recomputation compiles nothing more
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-2, msg=name)


def _beit() -> MaskedPatchPrediction:
    norm = dict(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    return MaskedPatchPrediction(tiny_vit(0).train(), MeanColor3Bit((4, 4), **norm), num_masked=6)


def _patch_mask(batch: int) -> torch.Tensor:
    mask = torch.zeros(batch, 4, 4, dtype=torch.bool)
    mask.view(batch, -1)[:, ::3] = True  # 6 of 16 patches per image
    return mask


OBJECTIVES = {
    "beit": (_beit, lambda b: {"image": _images(b), "mask": _patch_mask(b)}),
    "simmim": (lambda: SimMIM(tiny_vit(0).train()), lambda b: {"image": _images(b), "mask": _patch_mask(b)}),
    "classification": (
        lambda: Classification(tiny_vit(0, num_classes=4, global_pool="avg").train()),
        lambda b: {"image": _images(b), "label": torch.arange(b) % 4},
    ),
}


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_objectives_compile_their_blocks_in_one_graph_with_eager_losses_and_gradients(kind):
    build, batch = OBJECTIVES[kind]
    eager, compiled, counter = build(), build(), GraphCounter()
    assert compile_blocks(compiled, {8}, backend=counter) == 2
    torch.manual_seed(3)
    want = _train_step(eager, batch(8))
    torch.manual_seed(3)
    got = _train_step(compiled, batch(8))
    assert counter.graphs == 1  # both encoder blocks, forward and backward, in one graph each
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-2, msg=name)


def test_a_drop_path_schedule_over_12_blocks_shares_graphs_and_every_block_runs_compiled():
    """Stochastic depth rising over 12 blocks (0 to 0.1): a rate compiled in as a constant would make a graph per
    block (12 compiles), and past a recompile limit of 8 leave the later blocks eager."""
    compiled, counter = Classification(tiny_vit(0, depth=12, num_classes=4, drop_path_rate=0.1).train()), GraphCounter()
    assert compile_blocks(compiled, {8}, backend=counter) == 12
    eager = copy.deepcopy(compiled)  # the same modules, drop paths included, run eagerly (deep copies do)
    rates = [getattr(block.drop_path1, "drop_prob", 0.0) for block in compiled.model.blocks]
    assert rates == pytest.approx([0.1 * i / 11 for i in range(12)])
    for step in range(2):
        batch = {"image": _images(8, step), "label": torch.arange(8) % 4}
        torch.manual_seed(step)  # the same drop-path draws in both
        got = _train_step(compiled, batch)
        torch.manual_seed(step)
        want = _train_step(eager, batch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # block 0 (rate 0: timm leaves the drop path out) and blocks 1-11 (one graph whatever their rate)
    assert (counter.graphs, counter.backward_graphs) == (2, 2)
    assert counter.calls == 2 * 12  # every block of both steps ran compiled
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-2, msg=name)


def test_drop_path_rate_drops_whole_samples_and_rescales_the_kept():
    drop = DropPathRate(0.25).train()
    x = torch.randn(4000, 3, 2)
    torch.manual_seed(0)
    out = drop(x)
    kept = (out != 0).flatten(1).any(1)  # (B,) a sample's branch is kept or dropped whole
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    assert torch.equal(out[~kept], torch.zeros_like(x[~kept]))
    assert abs(1 - kept.float().mean().item() - 0.25) < 0.02
    assert torch.equal(drop.eval()(x), x) and drop.state_dict() == {}  # checkpoints stay those of an eager run


def _classifier(depth: int = 2) -> Classification:
    return Classification(tiny_vit(0, depth=depth, num_classes=4, global_pool="avg").train(), label_smoothing=0.1)


STEPS_20 = {  # objective, its batch, backend: inductor for the fine-tuning classifier (one graph to compile, about
    # 20 s on 2 cores), MAE through AOT autograd's own graphs (its four inductor compiles would take over a minute)
    "classification_inductor": (_classifier, lambda b, s: {"image": _images(b, s), "label": torch.arange(b) % 4}),
    "mae_aot_graphs": (lambda: _mae(depth=2), lambda b, s: {"image": _images(b, s)}),
}


@pytest.mark.parametrize("case", sorted(STEPS_20))
def test_same_losses_as_eager_for_20_steps_in_bf16(case):
    build, batch = STEPS_20[case]
    losses = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        objective = build()
        if mode == "compiled":
            compile_blocks(objective, {16}, backend="inductor" if case.endswith("inductor") else GraphCounter())
        optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-3)
        torch.manual_seed(1)  # the same masks and drop paths in both runs
        losses[mode] = []
        for step in range(20):
            losses[mode].append(_train_step(objective, batch(16, step)).item())
            optimizer.step()
            optimizer.zero_grad()
    assert losses["compiled"][-1] < losses["compiled"][0]  # it trains
    # bf16 autocast: compiled code rounds in other places (inductor fuses); per step within bf16's resolution
    torch.testing.assert_close(losses["compiled"], losses["eager"], atol=0, rtol=2e-2)


def test_parameter_names_stay_and_copies_run_eagerly():
    objective = _mae(depth=2)
    names = list(objective.state_dict())
    compile_blocks(objective, {8}, backend=GraphCounter())
    assert list(objective.state_dict()) == names  # no `_orig_mod.`: checkpoints and exports as eager
    assert describe_compiled(objective) == "encoder.blocks (2), decoder_blocks (2) at batches 8"
    assert isinstance(objective.encoder.blocks[0]._compiled_call_impl, BlockCall)
    twin = copy.deepcopy(objective)  # the FLOP counter's twin, an EMA: they must not run the original's blocks
    assert all(block._compiled_call_impl is None for block in twin.encoder.blocks)
    assert describe_compiled(twin) is None


def test_compile_config_zero3_refused_and_batch_sizes():
    with pytest.raises(ConfigError, match="engine.compile does not work with engine.zero_stage 3"):
        load_config(None, ["engine.compile=true", "engine.zero_stage=3"])
    assert "DeepSpeed" in ZERO3_COMPILE_REASON
    cfg = load_config(None, ["engine.compile=true", "engine.zero_stage=2", "data.global_batch_size=64"])
    assert compile_batch_sizes(cfg, world_size=2) == {32}
    knn = ["eval.knn.enabled=true", "eval.knn.batch_size_per_device=100", "data.train=x", "data.val=x"]
    cfg = load_config(None, ["engine.compile=true", "data.global_batch_size=64", *knn])
    assert compile_batch_sizes(cfg, world_size=1) == {64, 100}
    cfg = load_config(None, ["stage=finetune", "data.global_batch_size=64", "data.eval_batch_size_per_device=50"])
    assert compile_batch_sizes(cfg, world_size=4) == {16, 50}
