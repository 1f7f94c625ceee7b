"""Few-shot linear evaluation: closed-form regularised least squares from frozen features to {-1, +1}^K targets.

The ViT paper's quick probe of representation quality (section 4.6 uses it for the MPP ablations): draw n labelled
examples per class, fit a ridge regression from their frozen features to +-1 class indicators, and score the argmax
on held-out images, averaged over several random draws.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from accelerate import Accelerator

from mpp.data.stream import Batch
from mpp.errors import UserError, command
from mpp.model.vit import VisionTransformer, normalize, pool


class FewShotError(UserError):
    """The few-shot evaluation cannot run on the data given; the message names the data and the fix."""


@torch.no_grad()
def pooled_features(backbone: VisionTransformer, images: torch.Tensor, pooling: str) -> torch.Tensor:
    """uint8 images (B, 3, H, W) -> (B, D): the [class] token's output, or the mean of the patch outputs."""
    return pool(backbone(normalize(images)), pooling)


def fit_ridge(features: torch.Tensor, labels: torch.Tensor, num_classes: int, l2: float):
    """Least squares with an L2 penalty onto +-1 targets; returns a function mapping features to class scores.

    Features are standardised with the training examples' statistics and the intercept is left unpenalised
    (centred targets), so `l2` only shrinks the weights. With fewer examples than dimensions the dual form
    X^T (X X^T + l2 I)^-1 Y is solved instead of (X^T X + l2 I)^-1 X^T Y; both give the same weights.
    """
    x = features.double()
    mean, std = x.mean(dim=0), x.std(dim=0, correction=0) + 1e-6
    x = (x - mean) / std  # (n, D)
    targets = 2.0 * torch.nn.functional.one_hot(labels, num_classes).double() - 1.0  # (n, K)
    bias = targets.mean(dim=0)
    y = targets - bias
    n, d = x.shape
    if n >= d:
        weights = torch.linalg.solve(x.T @ x + l2 * torch.eye(d, dtype=x.dtype), x.T @ y)  # (D, K)
    else:
        weights = x.T @ torch.linalg.solve(x @ x.T + l2 * torch.eye(n, dtype=x.dtype), y)

    def scores(test: torch.Tensor) -> torch.Tensor:  # (m, D) -> (m, K)
        return ((test.double() - mean) / std) @ weights + bias

    return scores


def check_pool(train_y: torch.Tensor, eval_y: torch.Tensor, shots: Iterable[int]) -> None:
    """Refuse a training pool that cannot give `n` examples of every class, for each n in `shots`.

    A class of the evaluation images that the pool lacks altogether is refused too: it could never be predicted, so
    the accuracy would measure how many classes the first images of the shards happen to hold (2 classes of 10: ~10%).
    """
    classes, counts = torch.unique(train_y, return_counts=True)
    evaluated = set(torch.unique(eval_y).tolist())
    missing = sorted(evaluated - set(classes.tolist()))
    if missing:
        listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise FewShotError(f"the few-shot training pool holds examples of {len(evaluated) - len(missing)} of the "
                           f"{len(evaluated)} classes of the evaluation images (none of class {listed}), so it could "
                           f"never predict the others; raise fewshot.train_images or use shards that mix classes "
                           f"(`{command('prepare')}` shuffles them)")
    for n in shots:
        short = [(int(c), int(have)) for c, have in zip(classes, counts) if have < n]
        if short:
            c, have = short[0]
            raise FewShotError(f"class {c} has only {have} examples in the few-shot training pool, fewer than {n} shots; "
                               f"raise fewshot.train_images or drop {n} from fewshot.shots")


def few_shot_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, eval_x: torch.Tensor, eval_y: torch.Tensor, *,
                      shots: Iterable[int], draws: int, l2: float, seed: int = 0) -> dict[int, list[float]]:
    """Accuracy on (eval_x, eval_y) of ridge classifiers fit to `n` random examples per class of the training pool.

    Returns {n: [accuracy of each draw]}. Randomness comes from a private generator, never the global RNG,
    so an evaluation inside a training run leaves the run's random stream untouched.
    """
    check_pool(train_y, eval_y, shots)
    classes = torch.unique(train_y)
    by_class = [torch.nonzero(train_y == c).squeeze(1) for c in classes]
    num_classes = int(max(classes.max(), eval_y.max())) + 1
    results: dict[int, list[float]] = {}
    for n in shots:
        results[n] = []
        for draw in range(draws):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + draw * 1009 + n)
            chosen = torch.cat([idx[torch.randperm(len(idx), generator=generator)[:n]] for idx in by_class])
            scores = fit_ridge(train_x[chosen], train_y[chosen], num_classes, l2)(eval_x)
            results[n].append((scores.argmax(dim=1) == eval_y).double().mean().item())
    return results


def gather_rows(accelerator: Accelerator, rows: torch.Tensor) -> torch.Tensor:
    """Concatenate every process's (n_r, ...) tensor in rank order; the n_r may differ (and be 0)."""
    if accelerator.num_processes == 1:
        return rows
    counts = accelerator.gather(torch.tensor([rows.shape[0]], device=accelerator.device)).tolist()
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = accelerator.gather(padded).reshape(len(counts), max(counts), *rows.shape[1:])
    return torch.cat([gathered[r, :c] for r, c in enumerate(counts)])


class LabelledImages:
    """Up to `limit` labelled images read once from a stream of batches and kept in memory (uint8).

    Each process keeps its part; together they hold the first `limit` images in rank order, so the set is the
    same at every evaluation and does not depend on how evenly the shards split over processes.
    With `need_labels=False` (the pretext validation) images without a cls label are welcome.
    """

    def __init__(self, accelerator: Accelerator, batches: Iterable[Batch], limit: int, what: str, need_labels: bool = True):
        images, labels, count = [], [], 0
        for batch in batches:
            images.append(batch.images)
            labels.append(batch.labels)
            count += batch.images.shape[0]
            if count >= limit:
                break
        if not images:
            self.images, self.labels = torch.zeros(0, 3, 1, 1, dtype=torch.uint8), torch.zeros(0, dtype=torch.long)
        else:
            self.images, self.labels = torch.cat(images)[:limit], torch.cat(labels)[:limit]
        counts = [self.images.shape[0]]
        if accelerator.num_processes > 1:
            counts = accelerator.gather(torch.tensor(counts, device=accelerator.device)).tolist()
        before = sum(counts[: accelerator.process_index])
        keep = max(0, min(counts[accelerator.process_index], limit - before))
        self.images, self.labels = self.images[:keep], self.labels[:keep]
        self.total = min(limit, sum(counts))
        if self.total == 0:
            raise FewShotError(f"the {what} hold no images; point them at shards with images")
        if not need_labels:
            return
        unlabelled = int(accelerator.reduce(torch.tensor(float((self.labels < 0).sum()), device=accelerator.device), "sum"))
        if unlabelled:
            raise FewShotError(f"{unlabelled} of the {self.total} images read from the {what} have no class label (cls); "
                               f"this evaluation needs labelled shards")

    @torch.no_grad()
    def features(self, accelerator: Accelerator, backbone: VisionTransformer, pooling: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features (total, D) float32 on the CPU and labels (total,), gathered from every process."""
        was_training = backbone.training
        backbone.eval()
        parts = [torch.zeros(0, backbone.width, device=accelerator.device)]
        for start in range(0, self.images.shape[0], batch_size):
            images = self.images[start : start + batch_size].to(accelerator.device)
            with accelerator.autocast():
                parts.append(pooled_features(backbone, images, pooling).float())
        backbone.train(was_training)
        return gather_rows(accelerator, torch.cat(parts)).cpu(), self.all_labels(accelerator)

    def all_labels(self, accelerator: Accelerator) -> torch.Tensor:
        """The labels (total,) of every process's images, in rank order, on the CPU."""
        return gather_rows(accelerator, self.labels.to(accelerator.device)).cpu()
