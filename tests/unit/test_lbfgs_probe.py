"""finetune/lbfgs_probe.py: L-BFGS logistic regression on known problems, the weight-decay choice, the features."""

import timm
import torch
import torch.nn.functional as F

from finetune.lbfgs_probe import accuracy, extract_features, fit_logistic_regression, probe


def _linearly_separable(num_samples: int, seed: int, margin: float = 0.5):
    """(N, 8) Gaussian points labelled by the argmax of a fixed linear map, those within `margin` of a boundary
    dropped: 4 classes that a linear classifier separates perfectly."""
    gen = torch.Generator().manual_seed(seed)
    true_weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(123))
    x = torch.randn(num_samples, 8, generator=gen) * 3 + 1.0  # not standardised: probe() does that
    scores = x @ true_weight  # (N, 4)
    top2 = scores.topk(2, dim=1).values
    keep = top2[:, 0] - top2[:, 1] > margin
    return x[keep], scores[keep].argmax(dim=1)


def test_fit_reaches_the_optimum_of_the_penalised_loss():
    x, y = _linearly_separable(600, seed=0)
    linear = fit_logistic_regression(x, y, num_classes=4, weight_decay=1e-2)

    weight = linear.weight.double().requires_grad_(True)
    bias = linear.bias.double().requires_grad_(True)
    loss = F.cross_entropy(x.double() @ weight.T + bias, y) + 0.5 * 1e-2 * weight.square().sum()
    loss.backward()
    assert weight.grad.abs().max() < 1e-4 and bias.grad.abs().max() < 1e-4  # a stationary point of a convex loss
    almost_free = fit_logistic_regression(x, y, num_classes=4, weight_decay=1e-6)
    assert accuracy(almost_free, x, y) == 1.0  # separable: found by the (almost) unpenalised fit
    assert almost_free.weight.norm() > 2 * linear.weight.norm()  # the penalty keeps the weights small


def test_separable_problem_is_solved_and_the_held_out_choice_prefers_little_decay():
    train, test = _linearly_separable(2000, seed=1), _linearly_separable(1000, seed=2)
    result = probe(train, test, num_classes=4, weight_decays=(1e-5, 1e-1, 10.0))

    assert result["top1"] >= 0.98 and result["train_top1"] >= 0.99
    assert result["held_out_top1"]["10.0"] < result["held_out_top1"]["1e-05"]  # strong decay underfits
    assert result["weight_decay"] in (1e-5, 1e-1)


def test_noise_labels_score_chance_and_ties_go_to_the_larger_decay():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=gen)
    y = torch.zeros(400, dtype=torch.int64)  # one class only: every penalty scores 1.0 on the held-out part
    result = probe((x, y), (x[:50], y[:50]), num_classes=2, weight_decays=(1e-4, 1.0, 1e-2))
    assert result["weight_decay"] == 1.0 and result["top1"] == 1.0

    labels = torch.randint(0, 2, (400,), generator=gen)  # unrelated to x: no better than chance on fresh data
    x_test, y_test = torch.randn(2000, 4, generator=gen), torch.randint(0, 2, (2000,), generator=gen)
    assert abs(probe((x, labels), (x_test, y_test), num_classes=2)["top1"] - 0.5) < 0.05


def test_features_are_the_normed_class_token_and_the_mean_of_the_normed_patch_tokens():
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, num_classes=0)
    images = torch.randn(6, 3, 16, 16)
    batches = [
        {"image": images[:4], "label": torch.tensor([0, 1, 2, 3])},
        {"image": images[4:], "label": torch.tensor([1, 0])},
    ]
    features, labels = extract_features(vit, batches, "fp32")

    with torch.no_grad():
        tokens = vit.norm(vit.blocks(vit._pos_embed(vit.patch_embed(images))))  # (6, 17, 192)
    torch.testing.assert_close(features["cls"], tokens[:, 0])
    torch.testing.assert_close(features["mean"], tokens[:, 1:].mean(dim=1))
    assert labels.tolist() == [0, 1, 2, 3, 1, 0] and not vit.training


def test_the_command_adds_few_shot_top1_per_pooling_and_shot_count(tmp_path):
    """`--fewshot 1,3` on a random ViT's features of synthetic shards (4 classes): the mean of 3 draws per count."""
    import json

    from finetune.lbfgs_probe import main
    from tests.launching import finetune_recipe, write_recipe, write_synthetic

    shards = {split: write_synthetic(tmp_path / split, split, n, 20, seed) for split, n, seed in
              (("train", 40, 0), ("val", 20, 1))}  # fmt: skip
    recipe = finetune_recipe(shards, tmp_path / "run", tmp_path / "none")
    recipe["model"].pop("init")
    out = tmp_path / "probe.json"
    assert main([str(write_recipe(tmp_path / "probe.yaml", recipe)), "--out", str(out), "--fewshot", "1,3"]) == 0
    result = json.loads(out.read_text())
    for pooling in ("cls", "mean"):
        fewshot = result[pooling]["fewshot_top1"]
        assert set(fewshot) == {"1", "3"} and all(0.0 <= v <= 1.0 for v in fewshot.values())
        assert all(abs(v * 20 * 3 - round(v * 20 * 3)) < 1e-6 for v in fewshot.values())  # 3 draws of 20 queries
