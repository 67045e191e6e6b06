"""DINO's weighted k-nearest-neighbour classifier (`eval_knn.py`) over frozen features: each query is classified by
a vote of its k most similar bank features, cosine similarity of L2-normalised features, each neighbour voting for
its class with weight exp(similarity / temperature). The pretraining kNN monitor (pretrain/knn.py) and
`mimpipe evaluate` (finetune/report_card.py) both score with it.

Shapes: N bank samples, Q queries, D feature width, C classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.report.metrics import topk_correct

_QUERY_CHUNK = 1024  # queries scored at once: the (chunk, N) similarity matrix bounds the memory


@dataclass(frozen=True)
class KNNBank:
    """The labelled bank that classifies queries by DINO's weighted k-NN vote.

    Args:
        features: (N, D) L2-normalised bank features.
        labels: (N,) class indices of the bank.
        k: Neighbours that vote (all N when N < k).
        temperature: A neighbour with cosine similarity s votes exp(s / temperature) for its class.
        num_classes: C.
    """

    features: torch.Tensor
    labels: torch.Tensor
    k: int
    temperature: float
    num_classes: int

    def votes(self, queries: torch.Tensor) -> torch.Tensor:
        """(Q, D) L2-normalised query features -> (Q, C) float32 votes: for each query, the summed weights of its k
        nearest bank samples per class."""
        similarity = queries.float() @ self.features.float().T  # (Q, N)
        top_similarity, top_index = similarity.topk(min(self.k, len(self.features)), dim=1)  # (Q, k), nearest first
        weights = (top_similarity / self.temperature).exp()  # (Q, k)
        votes = torch.zeros(len(queries), self.num_classes, device=queries.device)  # (Q, C)
        return votes.scatter_add_(1, self.labels[top_index], weights)

    def correct(self, queries: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
        """(2,) int64: how many of the (Q, D) queries have their label (Q,) as the top-1 and among the top-5 vote
        winners (scored `_QUERY_CHUNK` queries at a time)."""
        correct = torch.zeros(2, dtype=torch.int64, device=queries.device)
        for start in range(0, len(queries), _QUERY_CHUNK):
            chunk = slice(start, start + _QUERY_CHUNK)
            correct += topk_correct(self.votes(queries[chunk]), query_labels[chunk], ks=(1, 5))
        return correct
