"""k-nearest-neighbour classification of frozen features, as DINO evaluates them (Caron et al. 2021).

Features are L2-normalised; each query takes its k most cosine-similar training examples, and each neighbour
votes for its class with weight exp(similarity / T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def knn_predict(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, num_classes: int, *, k: int = 20,
                temperature: float = 0.07, chunk: int = 1024) -> torch.Tensor:
    """(n, D) features with labels (n,), queries (m, D) -> predicted classes (m,).

    Queries go in chunks so the (chunk, n) similarity matrix stays small; k is capped at n.
    """
    train = F.normalize(train_x.float(), dim=1)
    predictions = []
    for start in range(0, test_x.shape[0], chunk):
        query = F.normalize(test_x[start : start + chunk].float(), dim=1)
        similarity, index = (query @ train.T).topk(min(k, train.shape[0]), dim=1)  # (c, k)
        votes = torch.zeros(query.shape[0], num_classes, dtype=torch.float64)
        votes.scatter_add_(1, train_y[index], (similarity.double() / temperature).exp())
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions) if predictions else torch.zeros(0, dtype=torch.long)


def knn_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor, *,
                 k: int = 20, temperature: float = 0.07) -> float:
    """Top-1 accuracy of knn_predict on (test_x, test_y)."""
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    predicted = knn_predict(train_x, train_y, test_x, num_classes, k=k, temperature=temperature)
    return (predicted == test_y).double().mean().item()


def missing_classes(train_y: torch.Tensor, test_y: torch.Tensor) -> tuple[list[int], float]:
    """The classes of the queries that no training example has, and the share of the queries in them: those can
    never be classified right, so top-1 is at most 1 minus that share."""
    missing = sorted(set(torch.unique(test_y).tolist()) - set(torch.unique(train_y).tolist()))
    return missing, torch.isin(test_y, torch.tensor(missing, dtype=test_y.dtype)).double().mean().item()
