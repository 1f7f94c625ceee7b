"""Accuracy class by class. On an evaluation set whose classes are not balanced, top-1 rewards answering the largest
class (a set whose largest class holds 49% of its images gives 49% top-1 to a model that always answers it); the mean
of the per-class recalls, balanced accuracy, gives that model 1 / classes and weighs every class the same."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def class_recalls(correct: Sequence[float], images: Sequence[float]) -> dict[int, float]:
    """{class id: the share of its evaluation images classified right} for every class with evaluation images."""
    return {label: hits / count for label, (hits, count) in enumerate(zip(correct, images)) if count}


def balanced_accuracy(recalls: dict[int, float]) -> float:
    """The mean of the per-class recalls over the classes the evaluation images hold (scikit-learn's
    balanced_accuracy_score)."""
    return sum(recalls.values()) / len(recalls)


def per_class_report(classified: Iterable[tuple[int, int]], names: Sequence[str], classes: int) -> dict[str, dict]:
    """results.json's per_class: {class name (its id where unnamed): {"id", "images", "top1"}} from (label, top-1 class)
    pairs, for every class with evaluation images, in id order."""
    correct, images = [0] * classes, [0] * classes
    for label, predicted in classified:
        images[label] += 1
        correct[label] += int(label == predicted)
    return {(names[label] if label < len(names) else str(label)): {"id": label, "images": images[label], "top1": recall}
            for label, recall in class_recalls(correct, images).items()}
