"""Few-shot linear evaluation: the closed-form fit against a case solved by hand and against a brute-force
leave-one-out, the support sets per class and per seed, and accuracy on separable features."""

from __future__ import annotations

import torch

from core.report.fewshot import REGULARISATION, fewshot_correct, ridge_fit, support_indices, targets


def test_two_points_on_a_line_are_fitted_as_solved_by_hand():
    x = torch.tensor([[-1.0], [1.0]])
    weight, bias, lam = ridge_fit(x, targets(torch.tensor([0, 1]), 2))
    # centred x = (-1, 1), y = ((1, -1), (-1, 1)): W = (x^T x + lam)^-1 x^T y = (-2, 2) / (2 + lam), b = 0
    expected = torch.tensor([[-2.0, 2.0]], dtype=torch.float64) / (2 + lam)
    assert torch.allclose(weight, expected) and torch.allclose(bias, torch.zeros(2, dtype=torch.float64))


def _brute_loo(x: torch.Tensor, y: torch.Tensor, lam: float) -> float:
    """Squared leave-one-out residuals, refitting the primal ridge (unpenalised bias) without each sample."""
    total = 0.0
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        xk, yk = x[keep], y[keep]
        xm, ym = xk.mean(0), yk.mean(0)
        w = torch.linalg.solve(
            (xk - xm).T @ (xk - xm) + lam * torch.eye(x.shape[1], dtype=x.dtype), (xk - xm).T @ (yk - ym)
        )
        total += float(((y[i] - (ym + (x[i] - xm) @ w)) ** 2).sum())
    return total


def test_the_regularisation_is_the_brute_force_leave_one_out_choice_and_the_fit_the_primal_solution():
    torch.manual_seed(0)
    x = torch.randn(12, 5, dtype=torch.float64)
    labels = torch.arange(12) % 3
    x[:, 0] += labels * 0.8  # some signal, some noise
    y = targets(labels, 3)
    weight, bias, lam = ridge_fit(x, y)
    unit = float(((x - x.mean(0)) ** 2).sum(1).mean())
    brute = {scale * unit: _brute_loo(x, y, scale * unit) for scale in REGULARISATION}
    assert lam == min(brute, key=brute.get)
    xm, ym = x.mean(0), y.mean(0)
    primal = torch.linalg.solve((x - xm).T @ (x - xm) + lam * torch.eye(5, dtype=x.dtype), (x - xm).T @ (y - ym))
    assert torch.allclose(weight, primal) and torch.allclose(bias, ym - xm @ primal)


def test_support_sets_hold_the_shots_of_every_class_and_differ_by_seed():
    labels = torch.tensor([0, 1, 2] * 10 + [3])  # class 3 has one image
    chosen = support_indices(labels, 5, seed=0)
    assert torch.bincount(labels[chosen]).tolist() == [5, 5, 5, 1]
    assert torch.equal(chosen, support_indices(labels, 5, seed=0))
    assert not torch.equal(chosen, support_indices(labels, 5, seed=1))


def test_separable_features_are_classified_from_one_image_per_class():
    torch.manual_seed(0)
    centres = torch.eye(4) * 10
    bank_labels = torch.arange(40) % 4
    bank = centres[bank_labels] + torch.randn(40, 4)
    query_labels = torch.arange(20) % 4
    queries = centres[query_labels] + torch.randn(20, 4)
    correct = fewshot_correct(bank, bank_labels, queries, query_labels, shots=1, num_classes=4)
    assert correct.tolist() == [20.0, 20.0, 20.0]  # three draws, every query right
