"""Linear probe (frozen encoder, foldable BN head), the EMA of weights, and DeiT distillation losses."""

import math

import pytest
import timm
import torch
import torch.nn.functional as F

from core.recipe.config import load_config
from finetune.classification import Classification
from finetune.distillation import Distillation, distillation_loss, to_distilled
from finetune.probe_ema import WeightEMA, fold_probe_head, make_linear_probe
from finetune.teacher import load_teacher
from tests.helpers.models import tiny_vit


def test_linear_probe_trains_only_the_head_and_folds_exactly():
    model = make_linear_probe(tiny_vit(num_classes=5, global_pool="avg"))
    objective = Classification(model).train()  # as the engine trains it
    encoder_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("head.")}
    optimizer = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    for _ in range(3):
        batch = {"image": torch.randn(8, 3, 16, 16), "label": torch.randint(0, 5, (8,))}
        objective(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in encoder_before.items())  # encoder frozen
    assert {n for n, p in objective.named_parameters() if p.requires_grad} == {
        "model.head.1.weight",
        "model.head.1.bias",
    }
    model.eval()
    images = torch.randn(4, 3, 16, 16)
    plain = tiny_vit(num_classes=5, global_pool="avg")
    plain.load_state_dict(fold_probe_head(model.state_dict()), strict=True)
    plain.eval()
    torch.testing.assert_close(plain(images), model(images), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("arch", "classifier"), [("t2t_vit_t_14", "head"), ("vt_resnet18", "fc")], ids=["t2t_vit", "vt_resnet"]
)
def test_linear_probe_on_the_other_encoders_freezes_batch_norm_statistics_and_folds(arch, classifier):
    """VT-ResNet's ResNet stages have BatchNorm: in the probe they normalise with their frozen running statistics,
    which training steps leave alone, so the probe's training features are the ones it is evaluated on."""
    widths = {"embed_dim": 32, "depth": 1, "num_heads": 2} if arch.startswith("t2t") else {"token_dim": 32}
    torch.manual_seed(0)
    model = make_linear_probe(timm.create_model(arch, img_size=32, num_classes=5, **widths))
    objective = Classification(model).train()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith(f"{classifier}.")}
    optimizer = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    for _ in range(3):
        batch = {"image": 3 * torch.randn(8, 3, 32, 32) + 1, "label": torch.randint(0, 5, (8,))}  # far from N(0, 1)
        objective(batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())  # weights and running statistics
    assert {n for n, p in objective.named_parameters() if p.requires_grad} == {
        f"model.{classifier}.1.weight",
        f"model.{classifier}.1.bias",
    }
    images = torch.randn(4, 3, 32, 32)
    train_logits = model(images)  # training mode: only the probe's own BatchNorm1d uses the batch statistics
    model.eval()
    plain = timm.create_model(arch, img_size=32, num_classes=5, **widths).eval()
    plain.load_state_dict(fold_probe_head(model.state_dict()), strict=True)
    torch.testing.assert_close(plain(images), model(images), rtol=1e-4, atol=1e-5)
    features = plain.forward_head(plain.forward_features(images), pre_logits=True)  # the frozen encoder's, in eval
    torch.testing.assert_close(model.forward_head(model.forward_features(images), pre_logits=True), features)
    assert not torch.allclose(train_logits, model(images))  # the probe's BatchNorm1d does change with the mode


def test_linear_probe_names_a_model_without_a_linear_classifier():
    with pytest.raises(
        ValueError, match="linear probe needs a Linear classifier `head` or `fc`, got {'head': 'Identity'}"
    ):
        make_linear_probe(tiny_vit(num_classes=0))


def test_ema_follows_the_hand_computed_average():
    model = torch.nn.Linear(2, 1)
    ema = WeightEMA(model, decay=0.75)
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(4.0)
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, start + 0.25 * 4.0)  # 0.75 * w0 + 0.25 * (w0 + 4)
    assert list(ema.parameters()) == []  # the average is in buffers: no optimizer or fp16 cast touches it
    ema.train()
    assert not ema.module.training


def test_ema_stays_fp32_and_moves_when_deepspeed_casts_the_objective_to_fp16():
    model = torch.nn.Linear(2, 1)
    objective = torch.nn.ModuleDict({"model": model, "ema": WeightEMA(model, decay=0.9999)})
    for p in objective.parameters():  # what DeepSpeed's fp16 mode does: parameters only, buffers left as they are
        p.data = p.data.half()
    ema = objective["ema"].module
    start = ema.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    objective["ema"].update(model)
    assert ema.weight.dtype == torch.float32
    torch.testing.assert_close(ema.weight, start + 1e-4 * (model.weight.float() - start))
    assert (ema.weight - start).abs().min() > 5e-5  # in fp16 a step of 1e-4 would round away near |w| = 0.5


def test_soft_and_hard_distillation_losses_on_hand_values():
    dist_logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    teacher = torch.tensor([[0.0, 2.0], [0.0, 3.0]])
    assert math.isclose(
        distillation_loss(dist_logits, teacher, kind="hard", tau=1.0).item(),
        F.cross_entropy(dist_logits, torch.tensor([1, 1])).item(),
        rel_tol=1e-6,
    )
    tau = 2.0
    p_t = F.softmax(teacher / tau, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(dist_logits / tau, -1))).sum()
    expected = kl * tau**2 / dist_logits.numel()  # DeiT: summed KL x tau^2 over the number of logits
    assert math.isclose(
        distillation_loss(dist_logits, teacher, kind="soft", tau=tau).item(), expected.item(), rel_tol=1e-5
    )


def test_distillation_objective_combines_the_two_losses_and_averages_heads_in_eval():
    plain = tiny_vit(num_classes=5, seed=1)
    student = tiny_vit(num_classes=5, distilled=True, seed=2)
    new = to_distilled(plain, student)
    assert set(new) == {"dist_token", "head_dist.weight", "head_dist.bias"}
    torch.testing.assert_close(student.pos_embed[:, 1], plain.pos_embed[:, 0])  # dist position from the cls one
    teacher = tiny_vit(num_classes=5, seed=3)
    objective = Distillation(student, teacher, kind="hard", alpha=0.5).train()  # as the engine trains it
    batch = {"image": torch.randn(6, 3, 16, 16), "label": torch.randint(0, 5, (6,))}
    out = objective(batch)
    torch.testing.assert_close(out["loss"], 0.5 * out["loss_base"] + 0.5 * out["loss_teacher"])
    out["loss"].backward()
    # Each head learns from its own half of the loss: the class head from the labels, the other from the teacher's
    # hard decisions.
    logits, dist_logits = student(batch["image"])  # (B, K) each
    (label_part,) = torch.autograd.grad(0.5 * F.cross_entropy(logits, batch["label"]), student.head.weight)
    teacher_labels = teacher(batch["image"]).argmax(dim=-1)
    (teacher_part,) = torch.autograd.grad(0.5 * F.cross_entropy(dist_logits, teacher_labels), student.head_dist.weight)
    assert teacher_part.abs().sum() > 0 and label_part.abs().sum() > 0
    torch.testing.assert_close(student.head_dist.weight.grad, teacher_part)
    torch.testing.assert_close(student.head.weight.grad, label_part)
    assert not any(p.grad is not None for p in teacher.parameters()) and "teacher" not in dict(
        objective.named_modules()
    )
    objective.eval()
    with torch.no_grad():
        logits = objective(batch)["logits"]
        student.set_distilled_training(False)
        x = student.forward_features(batch["image"])
        expected = (student.head(x[:, 0]) + student.head_dist(x[:, 1])) / 2
    torch.testing.assert_close(logits, expected.float())


def test_distillation_needs_a_distilled_student():
    with pytest.raises(ValueError, match="distillation token"):
        Distillation(tiny_vit(num_classes=5), tiny_vit(num_classes=5), kind="soft")
    assert timm.is_model("deit_tiny_distilled_patch16_224")


def test_teacher_from_a_bare_checkpoint_needs_its_architecture(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=5).eval()
    torch.save(source.state_dict(), tmp_path / "teacher.pth")
    overrides = [
        "stage=finetune",
        "model.img_size=32",
        f"distill.teacher={tmp_path / 'teacher.pth'}",
        "distill.kind=hard",
    ]
    with pytest.raises(ValueError, match="teacher_arch"):
        load_teacher(load_config(None, overrides), 5, _Console(), torch.device("cpu"))
    cfg = load_config(None, [*overrides, "distill.teacher_arch=vit_tiny_patch16_224"])
    with pytest.raises(ValueError):  # depth 12 architecture vs a depth-2 checkpoint: named keys missing
        load_teacher(cfg, 5, _Console(), torch.device("cpu"))
    source12 = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5).eval()
    torch.save(source12.state_dict(), tmp_path / "teacher.pth")
    teacher = load_teacher(cfg, 5, _Console(), torch.device("cpu"))
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(teacher(images), source12(images), rtol=1e-4, atol=1e-4)
    assert not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ValueError, match=r"head.weight: checkpoint \(5, 192\) vs model \(7, 192\)"):
        load_teacher(cfg, 7, _Console(), torch.device("cpu"))


class _Console:
    def console(self, text: str) -> None:
        pass
