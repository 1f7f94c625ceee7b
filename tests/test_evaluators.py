"""Evaluators from config: one class and one EVALUATORS line put an evaluator into training, nothing else."""

import pytest
import torch
from pydantic import Field
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from mpp.config import ConfigError, Section, config_reference, load_config
from mpp.data.stream import Batch
from mpp.metrics import Category, Metric
from mpp.training.runtime import make_accelerator
from pipelines.evaluations import evaluators
from pipelines.stages import pretrain
from pipelines.evaluations.evaluators import Stage, TopK, build_evaluators
from pipelines.evaluations.registry import EVALUATORS, Registration
from pipelines.run.loaders import KeptPass

from conftest import TINY, exported_card, where_metrics_show
from test_fewshot import tiny


class WidthProbeConfig(Section):
    every: int = Field(0, ge=0, description="Record the backbone's width every N steps (0 = off).")


# A chart group of its own, declared beside the metric that logs into it: between evaluation (30) and kNN (40).
WIDTH_PROBE = Category("width probe", order=35, card_rank=5)


class Probe:
    """A test-local evaluator: records what it was built for and the steps it ran at, and declares what it scores."""

    built: list[Stage] = []
    steps: list[int] = []
    metrics = (Metric("probe/width", WIDTH_PROBE, "width of the backbone", headline=True),)

    def __init__(self, cfg, accelerator, stage):
        Probe.built.append(stage)

    def __call__(self, objective, step):
        Probe.steps.append(step)
        return {"probe/width": float(objective.backbone.width)}


def test_a_registered_evaluator_runs_during_pretraining_and_shows_everywhere(tmp_path, make_shards, monkeypatch):
    # One class and one EVALUATORS line: run at its period, charted, an HParams column, in results.json and the card.
    # Its own config section comes with the line: validated, in the config reference, --help and config.yaml.
    monkeypatch.setitem(EVALUATORS, "probe", Registration(("pretrain",), lambda cfg: cfg.widthprobe.every, Probe,
                                                          ("widthprobe", WidthProbeConfig)))
    monkeypatch.setattr(Probe, "built", [])
    monkeypatch.setattr(Probe, "steps", [])
    with pytest.raises(ConfigError, match="'widthprobe.every': Input should be greater than or equal to 0"):
        load_config(None, ["widthprobe.every=-1"])
    assert ("widthprobe.every", "0", WidthProbeConfig.model_fields["every"].description) in config_reference()
    make_shards([40] * 2, size=32)
    pretrain.run(tiny(tmp_path, "eval.every=0", "widthprobe.every=2"))
    assert load_config(tmp_path / "run" / "config.yaml").widthprobe.every == 2
    assert [(s.name, s.classes) for s in Probe.built] == [("pretrain", None)] and Probe.steps == [2, 4, 6]
    events = next((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents*"))
    assert [e.step for e in EventAccumulator(str(events.parent)).Reload().Scalars("probe/width")] == [2, 4, 6]
    shows = where_metrics_show(tmp_path / "run", "pretrain")
    assert shows["charts"]["width probe"] == ["probe/width"] and "probe/width" in shows["hparams"]
    assert list(shows["charts"]).index("width probe") == list(shows["charts"]).index("training") + 1  # by its order
    assert shows["results"]["final"]["probe/width"] == 64
    assert "probe/width 64" in exported_card(tmp_path / "run", tmp_path / "hf")


def test_only_the_stages_evaluators_that_its_config_turns_on_are_built(monkeypatch):
    built = []
    fewshot = EVALUATORS["fewshot"].section  # the registry holds the sections too: "a" brings the one it reads
    monkeypatch.setattr(evaluators, "EVALUATORS", {
        name: Registration(stages, every, lambda cfg, accelerator, stage, name=name: built.append(name) or Probe, section)
        for name, stages, every, section in [("a", ("pretrain",), lambda cfg: cfg.fewshot.every, fewshot),
                                             ("b", ("finetune",), lambda cfg: 7, None),
                                             ("c", ("pretrain", "finetune"), lambda cfg: 5, None)]})
    cfg = load_config(None, ["fewshot.every=0"])
    assert [e.every for e in build_evaluators(cfg, None, Stage("pretrain"))] == [5] and built == ["c"]
    assert [e.every for e in build_evaluators(cfg, None, Stage("finetune"))] == [7, 5]
    assert [e.every for e in build_evaluators(load_config(None, ["fewshot.every=3"]), None, Stage("pretrain"))] == [3, 5]


def test_todays_config_sections_turn_the_built_in_evaluators_on():
    on = lambda *overrides: [name for name, r in EVALUATORS.items() if r.every(load_config(None, list(overrides)))]  # noqa: E731
    assert on() == ["top1"]  # fine-tuning's top-1 always; pretext validation only with data.val_shards
    assert on("data.val_shards=x", "fewshot.every=5", "knn.every=5", "probe.every=5", "inspect.every=5") == [
        "top1", "fewshot", "knn", "probe", "pretext", "inspect"]
    assert on("data.val_shards=x", "eval.every=0") == ["top1"]
    assert [n for n, r in EVALUATORS.items() if "finetune" in r.stages] == ["top1", "inspect"]


class ColourClassifier(nn.Module):
    """Logits from an image's mean colour: a fixed function of the pixels, so equal passes score alike."""

    def __init__(self, classes: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, classes, generator=torch.Generator().manual_seed(0)))

    def logits(self, images):
        return images.float().mean(dim=(2, 3)) @ self.weight


@pytest.mark.parametrize("workers", [0, 2])
def test_a_finetunings_evaluation_images_are_decoded_once_and_scored_alike_at_every_evaluation(tmp_path, make_shards,
                                                                                                workers):
    make_shards([30, 20], size=24)
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'run'}", *TINY, f"data.num_workers={workers}"])
    top = TopK(cfg, make_accelerator(cfg.train, cfg.output_dir), Stage("finetune", classes=10))
    classifier = ColourClassifier(10)
    first, predictions = top.scores(classifier), dict(top.predictions)
    assert len(predictions) == 50 and not any(batch.images.is_shared() for batch in top.batches.kept)
    (tmp_path / "shards").rename(tmp_path / "moved")  # a later evaluation that read the shards again would fail
    assert top.scores(classifier) == first and top.predictions == predictions


def test_an_evaluation_pass_is_kept_only_whole_and_within_its_limit():
    reads = []

    def read():
        reads.append(1)
        for i in range(3):
            yield Batch(torch.full((2, 3, 4, 4), i, dtype=torch.uint8), torch.tensor([i, i]), keys=(f"a{i}", f"b{i}"))

    def keys(batches):
        return [key for batch in batches for key in batch.keys]

    kept = KeptPass(read)
    assert keys(kept) == keys(kept) == ["a0", "b0", "a1", "b1", "a2", "b2"] and len(reads) == 1
    stopped = KeptPass(read)
    next(iter(stopped))  # a pass the caller left unfinished is read again in full
    assert keys(stopped) == keys(kept) and len(reads) == 3
    over = KeptPass(read, limit=2 * 3 * 4 * 4 * 2)  # two batches of the three fit: the set is read every time
    assert keys(over) == keys(over) == keys(kept) and len(reads) == 5 and over.kept is None
