"""The paper's inspection views: known answers for each, the explicit attention path against the kernel and against
transformers, the evaluator in pretraining and fine-tuning, and `inspect --ckpt` for runs and Hugging Face exports."""

import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import launch
from mpp.config import ConfigError, load_config
from mpp.evaluation.views import (attention_distance, attention_rollout, patch_filters, position_similarity,
                            rollout_to_patches)
from mpp.model.vit import Attention, VisionTransformer, patchify
from pipelines.stages import finetune, pretrain

from conftest import TINY, reset_accelerator, where_metrics_show, write_test_shards
from test_fewshot import tiny

VIEWS = ("filters", "position_similarity", "attention_distance", "rollout")


def uniform_maps(batch: int, heads: int, tokens: int, depth: int) -> list[torch.Tensor]:
    return [torch.full((batch, heads, tokens, tokens), 1.0 / tokens) for _ in range(depth)]


def test_attention_to_itself_alone_has_distance_zero():
    grid, depth = 4, 3
    identity = [torch.eye(1 + grid * grid).expand(2, 3, -1, -1) for _ in range(depth)]
    assert torch.equal(attention_distance(identity, grid, patch_size=8), torch.zeros(depth, 3))


def test_uniform_attention_has_the_grids_mean_pairwise_distance_in_pixels():
    grid, patch = 3, 16
    centres = [(r * patch, c * patch) for r in range(grid) for c in range(grid)]
    mean_pairwise = sum(math.dist(a, b) for a, b in itertools.product(centres, centres)) / len(centres) ** 2
    distance = attention_distance(uniform_maps(2, 4, 1 + grid * grid, depth=2), grid, patch)
    assert distance.shape == (2, 4)
    assert torch.allclose(distance, torch.full((2, 4), mean_pairwise), atol=1e-4)


def test_a_head_attending_to_a_horizontal_neighbour_has_distance_one_patch():
    grid, patch = 4, 8
    n = grid * grid
    maps = torch.zeros(1, 1, 1 + n, 1 + n)
    maps[0, 0, 0, 0] = 1  # [class] attends to itself, outside the image
    for i in range(n):
        neighbour = i + 1 if (i + 1) % grid else i - 1  # the patch to the right, or to the left in the last column
        maps[0, 0, 1 + i, 1 + neighbour] = 1
    assert attention_distance([maps], grid, patch).item() == pytest.approx(patch)


def test_sinusoidal_position_embeddings_are_less_alike_the_further_apart():
    # A 1-D sinusoidal embedding (Vaswani et al.) over 16 positions: the similarity of two positions depends on their
    # offset alone and falls with it: strictly over the first 8 offsets, and every farther pair is less alike.
    n, width = 16, 64
    positions = torch.arange(n, dtype=torch.float)[:, None]
    rates = torch.exp(-math.log(100.0) * torch.arange(0, width, 2) / width)
    table = torch.zeros(n, width)
    table[:, 0::2], table[:, 1::2] = torch.sin(positions * rates), torch.cos(positions * rates)
    similarity = position_similarity(torch.cat([torch.zeros(1, width), table])[None])  # [class] first, left out
    by_offset = similarity[0]
    assert similarity.shape == (n, n)
    assert all(similarity[i, j].item() == pytest.approx(by_offset[abs(i - j)].item(), abs=1e-5) for i in range(n) for j in range(n))
    assert all(a > b for a, b in zip(by_offset[:8], by_offset[1:8]))
    assert by_offset[8:].max() < by_offset[:8].min()


def test_rollout_of_uniform_attention_is_uniform_over_the_patches():
    tokens = 1 + 9
    rollout = attention_rollout(uniform_maps(2, 3, tokens, depth=4))
    assert torch.allclose(rollout.sum(dim=-1), torch.ones(2, tokens))  # each output's reach is a distribution
    for pooling in ("cls", "mean"):
        assert torch.allclose(rollout_to_patches(rollout, pooling), torch.full((2, 9), 1 / 9))


def test_rollout_of_attention_to_itself_alone_keeps_each_token_to_itself():
    identity = [torch.eye(5).expand(1, 2, -1, -1) for _ in range(3)]
    assert torch.allclose(attention_rollout(identity), torch.eye(5)[None])


def test_filter_components_come_back_in_the_patch_layout_and_explain_the_variance():
    # Filters that vary along one pattern only (red of the top-left pixel) have it as their first component.
    backbone = VisionTransformer(image_size=8, patch_size=4, width=32, depth=1, heads=2)
    pattern = torch.zeros(1, 3, 4, 4)
    pattern[0, 0, 0, 0] = 1.0
    with torch.no_grad():
        backbone.patch_embed.proj.weight.copy_(torch.linspace(-1, 1, 32)[:, None] * patchify(pattern, 4)[0])
    components, explained = patch_filters(backbone, count=3)
    assert components.shape == (3, 3, 4, 4)
    assert torch.allclose(components[0].abs(), pattern[0], atol=1e-5)
    assert explained[0].item() == pytest.approx(1.0, abs=1e-5)


def test_filters_of_a_grey_model_are_what_grey_images_meet():
    # Red minus green at the top-left pixel varies most between filters, but a grey image (R = G = B) never sees it;
    # summed over the channels, what is left is the grey pattern at pixel (1, 1).
    backbone = VisionTransformer(image_size=8, patch_size=4, width=32, depth=1, heads=2)
    colour, grey = torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)
    colour[0, 0, 0, 0], colour[0, 1, 0, 0] = 1.0, -1.0
    grey[0, :, 1, 1] = 1.0
    a, b = torch.linspace(-3, 3, 32), torch.linspace(-1, 1, 32).roll(7)
    with torch.no_grad():
        backbone.patch_embed.proj.weight.copy_(a[:, None] * patchify(colour, 4)[0] + b[:, None] * patchify(grey, 4)[0])
    assert torch.allclose(patch_filters(backbone, count=1)[0][0].abs(), colour[0].abs() / math.sqrt(2), atol=0.02)
    components, explained = patch_filters(backbone, count=1, grey=True)
    assert torch.allclose(components[0].abs(), grey[0], atol=1e-5) and explained[0].item() == pytest.approx(1.0, abs=1e-5)


def test_the_explicit_attention_path_matches_the_kernel():
    torch.manual_seed(0)
    attention = Attention(dim=32, heads=4)
    x = torch.randn(2, 17, 32)
    out, weights = attention.forward_with_weights(x)
    assert torch.allclose(out, attention(x), atol=1e-5)
    assert weights.shape == (2, 4, 17, 17) and torch.allclose(weights.sum(-1), torch.ones(2, 4, 17))
    backbone = VisionTransformer(image_size=16, patch_size=4, width=32, depth=3, heads=4, drop_path=0.2).eval()
    images = torch.randn(2, 3, 16, 16)
    encoded, maps = backbone.forward_with_attention(images)
    assert torch.allclose(encoded, backbone(images), atol=1e-5) and len(maps) == 3


def test_the_attention_weights_are_those_transformers_computes_for_the_exported_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mpp.model.hf import export_hf

    torch.manual_seed(0)
    backbone = VisionTransformer(image_size=16, patch_size=4, width=32, depth=2, heads=4).eval()
    export_hf(backbone, tmp_path / "hf")
    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        theirs = hf(pixel_values=images, output_attentions=True).attentions
        _, ours = backbone.forward_with_attention(images)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))


def inspected_pretraining(tmp_path, *overrides):
    return pretrain.run(tiny(tmp_path, "fewshot.every=0", "inspect.every=3", "inspect.images=16", "inspect.rollout_images=2",
                             *overrides))


def test_inspection_during_pretraining_draws_the_views_and_logs_the_distances_without_changing_the_run(tmp_path, make_shards):
    make_shards([40] * 3, size=32)
    # No panel and no inspection, against a panel and the inspection every 3 steps: the same weights, bit for bit.
    pretrain.run(tiny(tmp_path, "fewshot.every=0", "log.images_every=1000"))
    plain = load_file(tmp_path / "run" / "model.safetensors")
    reset_accelerator()
    (tmp_path / "run").rename(tmp_path / "plain")
    results = inspected_pretraining(tmp_path, "log.images_every=2")
    inspected = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(plain[k], inspected[k]) for k in plain)

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "pretrain"), size_guidance={"images": 0}).Reload()
    assert {f"inspect/{view}" for view in VIEWS} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("inspect/rollout")] == [3, 6]
    assert [e.step for e in events.Scalars("inspect/attention_distance_last")] == [3, 6]
    shows = where_metrics_show(tmp_path / "run", "pretrain")
    assert shows["charts"]["inspection"] == ["inspect/attention_distance_first", "inspect/attention_distance_last"]
    # Uniform attention over a 4 x 4 grid of 4-px patches spans 8.03 px on average; 6 steps leave a ViT near it.
    assert results["final"]["inspect/attention_distance_first"] == pytest.approx(8.03, abs=0.5)


def test_inspection_runs_in_fine_tuning_on_the_interpolated_position_embeddings(tmp_path, make_shards):
    make_shards([40] * 3, size=32)
    inspected_pretraining(tmp_path, "inspect.every=0")
    reset_accelerator()
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", f"data.val_shards={tmp_path / 'shards'}",
                             f"output_dir={tmp_path / 'ft'}", *TINY, "model.image_size=24", "train.steps=4",
                             "train.warmup_steps=1", "train.batch_size=8", "finetune.eval_every=4", "inspect.every=2",
                             "inspect.images=8", "inspect.rollout_images=2"])
    results = finetune.run(cfg, ckpt=str(tmp_path / "run"))
    assert results["final"]["inspect/attention_distance_last"] > 0
    events = EventAccumulator(str(tmp_path / "ft" / "tensorboard" / "finetune"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("inspect/position_similarity")] == [2, 4]


def test_inspect_command_writes_the_figures_and_numbers_of_a_run_and_of_its_hugging_face_export(tmp_path, make_shards, capsys):
    transformers = pytest.importorskip("transformers")
    make_shards([40] * 3, size=32)
    inspected_pretraining(tmp_path, "inspect.every=0")
    reset_accelerator()
    args = [f"inspect.shards={tmp_path / 'shards'}", "inspect.images=24", "inspect.rollout_images=3"]
    assert launch.main(["inspect", "--ckpt", str(tmp_path / "run"), f"output_dir={tmp_path / 'own'}", *args]) == 0
    assert "mean attention distance" in capsys.readouterr().out
    own = tmp_path / "own" / "inspect"
    assert all((own / f"{view}.png").stat().st_size > 1000 for view in VIEWS)
    numbers = json.loads((own / "inspect.json").read_text())
    assert numbers["grid"] == 4 and numbers["images"] == 24 and len(numbers["attention_distance_px"]) == 2
    assert len(numbers["position_similarity"]) == 16 and len(numbers["rollout"]["cls"]) == 3
    assert numbers["uniform_attention_distance_px"] == pytest.approx(8.032, abs=0.001)

    # Exported, loaded into transformers and saved again (the Hub's layout): the same views, number for number.
    reset_accelerator()
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    transformers.ViTModel.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "resaved")
    reset_accelerator()
    assert launch.main(["inspect", "--ckpt", str(tmp_path / "resaved"), f"output_dir={tmp_path / 'hf_views'}", *args]) == 0
    assert json.loads((tmp_path / "hf_views" / "inspect" / "inspect.json").read_text())["attention_distance_px"] == numbers["attention_distance_px"]


def test_hugging_face_weights_without_their_config_get_one_line(tmp_path, make_shards, capsys):
    make_shards([40] * 3, size=32)
    inspected_pretraining(tmp_path, "inspect.every=0")
    reset_accelerator()
    assert launch.main(["export", "--ckpt", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 0
    (tmp_path / "hf" / "config.json").unlink()
    capsys.readouterr()
    assert launch.main(["inspect", "--ckpt", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "holds a Hugging Face ViT but no ViT config.json" in err and "Traceback" not in err


def test_more_rollout_images_than_images_read_is_refused_at_load():
    with pytest.raises(ConfigError, match="inspect.rollout_images=8 is more than the inspect.images=4"):
        load_config(None, ["inspect.images=4", "inspect.rollout_images=8"])


def test_inspection_shards_without_images_get_one_line(tmp_path, make_shards, capsys):
    make_shards([40] * 3, size=32)
    inspected_pretraining(tmp_path, "inspect.every=0")
    reset_accelerator()
    write_test_shards(tmp_path / "empty", [0])
    assert launch.main(["inspect", "--ckpt", str(tmp_path / "run"), f"inspect.shards={tmp_path / 'empty'}",
                        f"output_dir={tmp_path / 'views'}"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "empty" / "shard-000000.tar") in err and "got no samples at all" in err and "Traceback" not in err


def test_rollout_figure_has_a_colour_bar_for_its_heat_maps():
    import numpy as np
    from pipelines.evaluations.inspection_figures import rollout_figure

    images = np.zeros((2, 3, 16, 16), dtype=np.uint8)
    figure = rollout_figure(images, {"[class]": np.random.rand(2, 4), "mean": np.random.rand(2, 4)}, grid=2)
    bars = [ax for ax in figure.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and "attention" in bars[0].get_ylabel()
