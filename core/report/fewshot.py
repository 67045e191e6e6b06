"""Few-shot linear evaluation, the ViT paper's fast evaluation (section 4, "few-shot accuracies"): a closed-form
regularised least-squares fit of frozen features to {-1, 1} class targets from a few labelled images per class.

For a support set X (n, D) with one-hot targets mapped to {-1, 1}, Y (n, K), the fit is ridge regression with an
unpenalised bias: with Xc, Yc centred, W = Xc^T (Xc Xc^T + lam I)^-1 Yc (the dual form: n is a few hundred, D may be
thousands), b = mean(Y) - mean(X) W; a query's class is the argmax of x W + b. The regularisation lam is chosen from
`REGULARISATION` (multiples of the kernel's mean diagonal, so the grid does not depend on the features' scale) by
closed-form leave-one-out: with the hat matrix H = J / n + K (K + lam I)^-1 (K = Xc Xc^T, J all ones), the residual of
sample i when it is left out of the fit is (y_i - yhat_i) / (1 - H_ii), exactly (ridge is a linear smoother); the lam
with the least squared leave-one-out residual wins. One eigendecomposition of K serves every lam.

`fewshot_correct` draws the support set `draws` times (a fixed seed each: the same images at every evaluation) from a
labelled bank and counts correct queries per draw; the caller averages (and sums over ranks).

Shapes: n support samples, D feature width, K classes, Q queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REGULARISATION = tuple(10.0**e for e in range(-4, 3))
"""lam grid, in units of the support kernel's mean diagonal (the features' mean squared norm after centring)."""
DRAWS = 3
"""Support sets drawn per evaluation; their accuracies are averaged."""


def ridge_fit(x: torch.Tensor, y: torch.Tensor, grid=REGULARISATION) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The least-squares fit of `y` (n, K) on `x` (n, D) with the leave-one-out choice of lam.

    Returns:
        W (D, K), b (K,), and the chosen lam (absolute), all in float64.
    """
    x, y = x.double(), y.double()
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean
    kernel = xc @ xc.T  # (n, n)
    values, vectors = torch.linalg.eigh(kernel)
    values = values.clamp(min=0)
    unit = float(kernel.diagonal().mean()) or 1.0
    projected = vectors.T @ yc  # (n, K)
    best = None
    for scale in grid:
        lam = scale * unit
        shrink = values / (values + lam)  # eigenvalues of K (K + lam I)^-1
        fitted = y_mean + vectors @ (shrink[:, None] * projected)  # (n, K)
        leverage = 1.0 / len(x) + (vectors**2 * shrink).sum(dim=1)  # diag(H)
        loo = ((y - fitted) / (1 - leverage).clamp(min=1e-12)[:, None]).pow(2).sum()
        if best is None or loo < best[0]:
            best = (loo, lam)
    lam = best[1]
    alpha = vectors @ (projected / (values + lam)[:, None])  # (K + lam I)^-1 Yc, (n, K)
    weight = xc.T @ alpha  # (D, K)
    return weight, y_mean - x_mean @ weight, lam


def targets(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(n,) labels -> (n, K) targets: 1 for the class, -1 elsewhere."""
    return 2.0 * F.one_hot(labels, num_classes).double() - 1.0


def support_indices(labels: torch.Tensor, shots: int, seed: int) -> torch.Tensor:
    """`shots` indices of each class present in `labels` (all of a class that has fewer), drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    picked = [order[labels[order] == c][:shots] for c in labels.unique().tolist()]
    return torch.cat(picked).sort().values


def fewshot_correct(
    bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, query_labels: torch.Tensor, *,
    shots: int, num_classes: int, draws: int = DRAWS, seed: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Correct queries of each of `draws` fits on `shots` images per class of the bank.

    Args:
        bank: (N, D) labelled features the support sets are drawn from; bank_labels (N,).
        queries: (Q, D) features to classify; query_labels (Q,).
        shots: Images per class in a support set.
        num_classes: K.
        draws: Support sets (seeds seed, seed + 1, ...).
        seed: The first draw's seed.

    Returns:
        (draws,) float64 counts of correctly classified queries.
    """
    bank, bank_labels = bank.detach().float().cpu(), bank_labels.cpu()
    queries, query_labels = queries.detach().float().cpu(), query_labels.cpu()
    correct = []
    for draw in range(draws):
        support = support_indices(bank_labels, shots, seed + draw)
        weight, bias, _ = ridge_fit(bank[support], targets(bank_labels[support], num_classes))
        predicted = (queries.double() @ weight + bias).argmax(dim=1)
        correct.append((predicted == query_labels).sum().double())
    return torch.stack(correct)
