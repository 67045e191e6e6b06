"""fp16 with frozen side models, on CPU: DeepSpeed's fp16 mode casts the objective's parameters to half and the loop
casts the batch's float tensors to half (core/engine/loop.py `to_device`), while a side model held outside the
module tree (the BEiT tokenizer, the distillation teacher) keeps its own dtype and must get its inputs in it."""

from __future__ import annotations

import torch

from core.engine.precision import to_device
from finetune.distillation import Distillation
from pretrain.beit import MaskedPatchPrediction
from pretrain.targets import TokenizerCodes
from pretrain.tokenizer import VQVAE
from tests.helpers.models import tiny_vit

CPU = torch.device("cpu")


def _inputs_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """The first positional input of every forward of `module` from now on."""
    seen = []
    module.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    return seen


def test_beit_tokenizer_gets_its_view_in_its_own_dtype_under_fp16():
    torch.manual_seed(0)
    tokenizer = VQVAE(img_size=16, downsample=4, codebook_size=8, code_dim=4, hidden_dim=8).eval()
    objective = MaskedPatchPrediction(
        tiny_vit(), TokenizerCodes(tokenizer, (4, 4)), num_masked=6
    ).half()  # as DeepSpeed casts it
    mask = torch.zeros(4, 4, 4, dtype=torch.bool)
    mask.view(4, -1)[:, ::3] = True
    batch = {"image": torch.randn(4, 3, 16, 16), "tokenizer_image": torch.randn(4, 3, 16, 16), "mask": mask}
    batch = to_device(batch, CPU, "fp16")
    assert batch["tokenizer_image"].dtype == torch.float16
    seen = _inputs_of(tokenizer.encoder)
    out = objective(batch)
    assert torch.isfinite(out["loss"])
    ((view,),) = [seen]
    assert view.dtype == torch.float32 and torch.equal(view, batch["tokenizer_image"].float())
    expected = tokenizer.encode(batch["tokenizer_image"].float()).flatten(1)[
        mask.flatten(1)
    ]  # the fp32 tokenizer's codes
    assert torch.equal(out["target"], expected)


def test_distillation_teacher_gets_the_images_in_its_own_dtype_under_fp16():
    student = tiny_vit(num_classes=5, distilled=True, seed=2)
    teacher = tiny_vit(num_classes=5, seed=3)
    objective = Distillation(student, teacher, kind="soft", alpha=0.5).half().train()  # the teacher stays fp32
    batch = to_device({"image": torch.randn(6, 3, 16, 16), "label": torch.randint(0, 5, (6,))}, CPU, "fp16")
    seen = _inputs_of(teacher)
    out = objective(batch)
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["loss_teacher"])
    ((images,),) = [seen]
    assert images.dtype == torch.float32 and torch.equal(images, batch["image"].float())
    with torch.no_grad():
        logits = teacher(batch["image"].float())
        _, dist_logits = (x.float() for x in student(batch["image"]))
    expected = (
        torch.nn.functional.kl_div(
            torch.log_softmax(dist_logits / 3.0, -1),
            torch.log_softmax(logits / 3.0, -1),
            reduction="sum",
            log_target=True,
        )
        * 9.0
        / dist_logits.numel()
    )
    torch.testing.assert_close(out["loss_teacher"], expected)
