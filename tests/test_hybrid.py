"""The paper's hybrid (a ResNet stem whose feature-map cells are the tokens) and the position-embedding kinds."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mpp.model.checkpoint import load_backbone, save_weights
from mpp.config import ConfigError, load_config
from mpp.evaluation.views import position_similarity
from mpp.model.vit import build_backbone
from mpp.model.objectives import masked_patch_prediction
from mpp.training.optim import param_groups
from mpp.rundir import complete_checkpoints
from mpp.model.targets import quantize_color_sums
from pipelines import cli
from pipelines.run.start import checkpoint_config

from conftest import TINY, TWO_PROCESSES
from test_distributed import run

# A CPU-sized hybrid: one stage of one unit after the root, stride 4 (TINY's patch size), 8 root channels.
HYBRID = ["model.stem=resnet", "model.stem_layers=[1]", "model.stem_width=8"]


def tiny(*overrides):
    return load_config(None, [*TINY, *overrides])


def test_a_hybrid_token_is_the_stride_sized_region_its_target_is_computed_from():
    cfg = tiny("model.stem=resnet", "model.stem_layers=[1,1]", "model.stem_width=8", "model.image_size=32", "model.patch_size=null")
    assert cfg.model.patch_size == 8  # the stem's stride: 4 in the root, 2 in the second stage
    objective = masked_patch_prediction(build_backbone(cfg.model), cfg, None)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    tokens = objective.backbone.embed_patches(images.float())
    targets = objective.targets(images)  # (B, N) mean-colour classes
    assert tokens.shape[1] == targets.shape[1] == objective.backbone.num_patches == 16
    for token in (0, 6, 13):  # row-major: token 6 is row 1, column 2
        r, c = divmod(token, 4)
        region = images[:, :, 8 * r: 8 * r + 8, 8 * c: 8 * c + 8].float().sum(dim=(2, 3))  # (B, 3)
        assert torch.equal(targets[:, token], quantize_color_sums(region, 64, 3))


def test_gradients_reach_the_stem_which_decays_as_the_lowest_layer_without_decaying_its_norms():
    cfg = tiny(*HYBRID, "model.image_size=32", "train.layer_decay=0.5")
    objective = masked_patch_prediction(build_backbone(cfg.model), cfg, None)
    objective(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)).loss.backward()
    root = objective.backbone.patch_embed.stem.root[0].weight
    assert root.grad is not None and root.grad.abs().sum() > 0
    assert objective.mask_patch.grad.abs().sum() > 0  # a hybrid's [mask] is a patch of pixels (mpp.corrupt_in=auto)
    groups = param_groups(objective, 0.5)
    group_of = {id(p): g for g in groups for p in g["params"]}
    lowest = min(g["lr_scale"] for g in groups)
    for name, param in objective.backbone.patch_embed.stem.named_parameters():
        assert group_of[id(param)]["lr_scale"] == lowest, name
        assert group_of[id(param)]["apply_weight_decay"] == (param.ndim > 1), name  # convolutions decay, GN does not


@pytest.mark.parametrize("pos_embed", ["learned", "learned_2d", "sincos_2d", "none"])
def test_a_hybrid_checkpoint_loads_for_finetuning_at_a_higher_resolution(tmp_path, pos_embed):
    cfg = tiny(*HYBRID, f"model.pos_embed={pos_embed}")
    objective = masked_patch_prediction(build_backbone(cfg.model), cfg, None)
    save_weights(objective, tmp_path / "model.safetensors")
    # Weights outside a run: the architecture comes from the file's metadata.
    finetune_cfg = checkpoint_config(str(tmp_path / "model.safetensors"), None, ["model.image_size=32"])
    assert (finetune_cfg.model.stem, finetune_cfg.model.stem_layers, finetune_cfg.model.pos_embed) == ("resnet", [1], pos_embed)
    backbone = load_backbone(tmp_path / "model.safetensors", finetune_cfg.model)
    assert backbone.grid == 8 and backbone.stem == "resnet"
    old = objective.backbone
    assert torch.equal(backbone.patch_embed.stem.root[0].weight, old.patch_embed.stem.root[0].weight)
    images = torch.randn(2, 3, 32, 32)
    assert backbone(images).shape == (2, 65, 64)
    table, old_table = backbone.position_embeddings(), old.position_embeddings()
    if pos_embed == "none":
        assert table is None
    else:  # the 4 x 4 grid's embeddings resampled (learned) or recomputed (sin-cos) for 8 x 8
        assert table.shape == (1, 65, 64) and not torch.equal(table[0, 1], table[0, 2])
        if pos_embed == "sincos_2d":
            assert torch.allclose(table[0, 1], old_table[0, 1])  # position (0, 0) is the same sin-cos at any grid
    same_size = load_backbone(tmp_path / "model.safetensors", tiny(*HYBRID, f"model.pos_embed={pos_embed}").model)
    same_size.eval(), old.eval()
    assert torch.allclose(same_size(images[:, :, :16, :16]), old(images[:, :, :16, :16]), atol=1e-5)


def grid_pairs(similarity: torch.Tensor, grid: int, dr: int, dc: int) -> torch.Tensor:
    """The similarities of every pair of positions (r, c), (r + dr, c + dc) on the grid."""
    values = [similarity[r * grid + c, (r + dr) * grid + c + dc] for r in range(grid - dr) for c in range(grid - max(dc, 0))
              if 0 <= c + dc < grid]
    return torch.stack(values)


def test_the_2d_position_kinds_give_the_similarity_view_its_row_and_column_structure():
    torch.manual_seed(0)
    grid = 6
    sincos = build_backbone(tiny("model.pos_embed=sincos_2d", "model.image_size=24", "model.width=128").model)
    similarity = position_similarity(sincos.position_embeddings())
    for dr, dc in ((0, 1), (1, 0), (1, 1), (2, -1)):  # the similarity depends on the offset alone
        pairs = grid_pairs(similarity, grid, dr, dc)
        assert torch.allclose(pairs, pairs[0].expand_as(pairs), atol=1e-5), (dr, dc)
    assert grid_pairs(similarity, grid, 0, 1)[0] > grid_pairs(similarity, grid, 0, 3)[0]  # nearer is more alike

    learned = build_backbone(tiny("model.pos_embed=learned_2d", "model.image_size=24", "model.width=512").model)
    similarity = position_similarity(learned.position_embeddings())
    rows = torch.arange(grid * grid) // grid
    cols = torch.arange(grid * grid) % grid
    same_row = (rows[:, None] == rows[None]) & (cols[:, None] != cols[None])
    same_col = (cols[:, None] == cols[None]) & (rows[:, None] != rows[None])
    neither = (rows[:, None] != rows[None]) & (cols[:, None] != cols[None])
    # At initialisation a shared row (or column) half makes two positions half alike; others are unrelated.
    assert similarity[same_row].mean() == pytest.approx(0.5, abs=0.1)
    assert similarity[same_col].mean() == pytest.approx(0.5, abs=0.1)
    assert similarity[neither].abs().mean() < 0.1
    assert position_similarity(build_backbone(tiny("model.pos_embed=none").model).position_embeddings()) is None


@pytest.mark.parametrize("overrides, message", [
    (["model.stem=resnet", "model.stem_layers=[1]", "model.patch_size=16"],
     "model.patch_size 16 does not match the ResNet stem's stride 4 (1 stages in model.stem_layers); set model.patch_size=4"),
    (["model.stem=resnet", "model.name=vit_ti16", "model.image_size=24"],
     "model.image_size 24 is not divisible by the ResNet stem's stride 16 (model.patch_size, from the 3 stages in model.stem_layers)"),
    (["model.stem=resnet", "model.stem_layers=[1,0]"], "model.stem_layers must count at least one unit per stage"),
    (["model.pos_embed=sincos_2d", "model.width=66", "model.heads=2"], "model.pos_embed=sincos_2d splits the width"),
])
def test_a_bad_hybrid_or_position_setting_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_hybrid_without_leak_masks_its_pixels_and_the_leaky_variant_is_a_setting():
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    pixels = masked_patch_prediction(build_backbone(tiny(*HYBRID).model), tiny(*HYBRID), None)
    leaky_cfg = tiny(*HYBRID, "mpp.corrupt_in=embeddings")
    leaky = masked_patch_prediction(build_backbone(leaky_cfg.model), leaky_cfg, None)
    assert pixels.corrupt_in == "pixels" and leaky.corrupt_in == "embeddings"
    assert "in pixels, before the stem" in pixels.description
    # With pixel corruption a masked patch's own pixels cannot change what the model predicts there.
    pixels.eval()
    corruption = pixels.draw_corruption(2, generator=torch.Generator().manual_seed(0))
    masked = corruption.positions[0, corruption.kinds[0] == 0][0].item()
    r, c = divmod(masked, 4)
    changed = images.clone()
    changed[0, :, 4 * r: 4 * r + 4, 4 * c: 4 * c + 4] = 255 - changed[0, :, 4 * r: 4 * r + 4, 4 * c: 4 * c + 4]
    assert torch.allclose(pixels.predict(images, corruption)[0][0], pixels.predict(changed, corruption)[0][0], atol=1e-5)
    leaky.eval()
    with torch.no_grad():
        leaky.backbone.patch_embed.stem.stages[0][0].norm3.weight.fill_(1.0)  # the residual branch live, as after training
    assert not torch.allclose(leaky.predict(images, corruption)[0][0], leaky.predict(changed, corruption)[0][0], atol=1e-5)


def test_a_hybrid_refuses_the_hf_export_in_one_line_naming_the_timm_export(tmp_path, capsys):
    cfg = tiny(*HYBRID)
    save_weights(masked_patch_prediction(build_backbone(cfg.model), cfg, None), tmp_path / "model.safetensors")
    assert cli.main(["export", "--ckpt", str(tmp_path / "model.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "hybrid ViT (model.stem=resnet), which transformers 5 has no class for" in err and "\n" not in err
    assert "--to timm DIR" in err
    assert not (tmp_path / "hf").exists()


def test_learned_2d_exports_to_transformers_as_the_table_it_adds(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny("model.pos_embed=learned_2d")
    backbone = build_backbone(cfg.model).eval()
    save_weights(masked_patch_prediction(backbone, cfg, None), tmp_path / "model.safetensors")
    assert cli.main(["export", "--ckpt", str(tmp_path / "model.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 0
    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf").eval()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(hf(pixel_values=images).last_hidden_state, backbone(images), atol=1e-4)


def test_no_position_embeddings_trains(tmp_path, make_shards):
    from pipelines.stages import pretrain
    make_shards([40], size=32)
    cfg = tiny(f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", "model.pos_embed=none",
               "train.steps=6", "train.warmup_steps=1", "train.batch_size=8", "train.lr=3e-3")
    pretrain.run(cfg)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert "pos_embed" not in load_file(tmp_path / "run" / "model.safetensors")
    assert results["final"]["train/pretext_loss"] < 6.2  # from ln(512) = 6.24 at the start


def test_a_hybrid_over_two_processes_compiled_resumes_exactly(tmp_path, make_shards):
    make_shards([30, 30], size=32)
    common = ["launch.py", "pretrain", f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY, *HYBRID,
              "model.pos_embed=learned_2d", "train.steps=6", "train.warmup_steps=1", "train.batch_size=4",
              "train.checkpoint_every=3", "train.keep_checkpoints=5", "data.num_workers=1", "train.mixed_precision=no",
              "train.compile=true", "train.compile_backend=aot_eager", "inspect.every=6", "inspect.images=8"]
    first = run([*TWO_PROCESSES, *common], timeout=400)
    assert "with 2 process(es)" in first.stdout and "compile on (aot_eager)" in first.stdout and "hybrid" in first.stdout
    uninterrupted = load_file(tmp_path / "run" / "model.safetensors")
    assert any(k.startswith("patch_embed.stem.") for k in uninterrupted)
    shutil.rmtree(complete_checkpoints(tmp_path / "run")[-1])
    (tmp_path / "run" / "model.safetensors").unlink()
    resumed_run = run([*TWO_PROCESSES, *common, "--resume"], timeout=400)
    assert re.search(r"resumed from .*step_00000003 at step 3", resumed_run.stdout)
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_an_arms_model_keys_hold_for_its_pretraining_and_every_fine_tuning():
    from pipelines.comparison.plan import arm_plan, load_compare_config, pretrain_config, stage_config
    from conftest import ROOT
    cc = load_compare_config(ROOT / "configs" / "compare" / "hybrid.yaml")
    arms = {arm.name: arm for arm in cc.arms}
    hybrid = arm_plan(cc, arms["mpp-hybrid"])
    assert pretrain_config(hybrid, arms["mpp-hybrid"]).model.stem == "resnet"
    assert stage_config(hybrid, "finetune", {"train.lr": 0.1}).model.stem == "resnet"  # a grid recipe on top
    assert stage_config(arm_plan(cc, arms["mpp-nopos"]), "finetune").model.pos_embed == "none"
    assert stage_config(arm_plan(cc, arms["scratch"]), "finetune").model.stem == "patch"
    assert "model.stem=resnet" in arms["mpp-hybrid"].summary
    leak_plan = load_compare_config(ROOT / "configs" / "compare" / "hybrid_leak.yaml")
    leaky = next(arm for arm in leak_plan.arms if arm.name == "mpp-hybrid-leak")  # corrupted after the stem: its pretraining alone says so
    assert pretrain_config(arm_plan(leak_plan, leaky), leaky).mpp.corrupt_in == "embeddings"
    assert pretrain_config(hybrid, arms["mpp-hybrid"]).mpp.corrupt_in == "auto"  # pixels, for a hybrid
