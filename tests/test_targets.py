import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from pydantic import Field

from mpp.config import ConfigError, Section, config_reference, load_config
from mpp.metrics import PRETEXT_LOSS, split_metric
from mpp.model.vit import normalize
from mpp.model.registry import TARGETS, TargetEntry
from mpp.model.targets import Target, color4x4_targets, color_class_to_rgb, mean_color_targets, pixel_targets
from pipelines.stages import pretrain

from conftest import TINY, exported_card, where_metrics_show
from pipelines import cli


def solid_patches(colors, patch):
    """A 1-row image of solid patches (3, patch, patch * len(colors)) as a batch of one."""
    cols = [torch.tensor(c, dtype=torch.uint8)[:, None, None].expand(3, patch, patch) for c in colors]
    return torch.cat(cols, dim=2)[None]


def color_id(r, g, b):
    return r * 64 + g * 8 + b


def test_mean_color_bins_at_edges():
    # 3 bits: bins of width 32, so 31 is the last value of bin 0 and 32 the first of bin 1.
    colors = [(0, 31, 32), (63, 64, 255), (223, 224, 128), (255, 255, 255)]
    images = solid_patches(colors, 4)
    expected = [color_id(0, 0, 1), color_id(1, 2, 7), color_id(6, 7, 4), color_id(7, 7, 7)]
    assert mean_color_targets(images, 4).tolist() == [expected]


def test_mean_color_of_mixed_patch():
    img = torch.zeros(1, 3, 4, 8, dtype=torch.uint8)
    img[:, :, :, 0:2] = 64  # patch 0: half 0, half 64 -> mean 32 -> bin 1 exactly on the edge
    img[:, :, :, 4:6] = 63  # patch 1: mean 31.5 -> bin 0
    img[:, 0, 0, 4] = 255  # red channel of patch 1 gains (255 - 63) / 16 = 12 -> mean 43.5 -> bin 1
    assert mean_color_targets(img, 4).tolist() == [[color_id(1, 1, 1), color_id(1, 0, 0)]]


def test_mean_color_grid_order_is_row_major():
    img = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    img[:, 2, 0:4, 4:8] = 255  # top-right patch blue
    img[:, 0, 4:8, 0:4] = 255  # bottom-left patch red
    assert mean_color_targets(img, 4).tolist() == [[0, color_id(0, 0, 7), color_id(7, 0, 0), 0]]


def test_color_bits_change_the_class_count():
    img = solid_patches([(255, 128, 0)], 2)
    assert mean_color_targets(img, 2, bits=1).tolist() == [[1 * 4 + 1 * 2 + 0]]


def test_color4x4_targets_shape_and_values():
    # one 8x8 patch: 4x4 cells of 2x2 pixels, cell (i, j) coloured (32 i, 32 j, 255)
    img = torch.zeros(2, 3, 8, 16, dtype=torch.uint8)
    for i in range(4):
        for j in range(4):
            img[:, 0, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = 32 * i
            img[:, 1, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = 32 * j
            img[:, 2, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = 255
    targets = color4x4_targets(img, 8)
    assert targets.shape == (2, 2, 16)
    assert targets[0, 0].tolist() == [color_id(i, j, 7) for i in range(4) for j in range(4)]
    assert targets[0, 1].tolist() == [0] * 16


def test_pixel_targets_follow_patch_embedding_order():
    img = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    targets = pixel_targets(img, 4)
    assert targets.shape == (2, 4, 4 * 4 * 3)
    patch = normalize(img)[1, :, 4:8, 0:4]  # bottom-left patch of image 1 -> index 2
    assert torch.allclose(targets[1, 2], rearrange(patch, "c p1 p2 -> (p1 p2 c)"))
    assert targets.min() >= -1 and targets.max() <= 1


def test_class_to_rgb_returns_bin_centres():
    assert color_class_to_rgb(torch.tensor([color_id(0, 7, 3)])).tolist() == [[16, 240, 112]]


class GraySettings(Section):
    hparams = ("gray_gamma",)

    gray_gamma: float = Field(1.0, gt=0, description="Gamma of the grey target: mean grey level ** gamma, in [0, 1].")


class MeanGray(Target):
    """A test-local target: each patch's mean grey level, raised to mpp.gray_gamma and mapped to [-1, 1], regressed."""

    description = "its mean grey level (L1-scored regression)"

    def __init__(self, patch_size, gamma=1.0):
        super().__init__(patch_size)
        self.outputs, self.gamma = 1, gamma

    @classmethod
    def from_settings(cls, patch_size, settings):
        return cls(patch_size, settings.gray_gamma)

    def __call__(self, images):  # (B, N, 1)
        grey = pixel_targets(images, self.patch_size).mean(-1, keepdim=True) * 0.5 + 0.5
        return grey.clamp(min=0) ** self.gamma * 2 - 1

    def loss(self, predictions, targets):
        return F.mse_loss(predictions, targets), {"gray_error": (predictions - targets).abs().mean()}

    def metrics(self, split):
        return [split_metric(split, PRETEXT_LOSS, "pretext loss", headline=True, bar="loss"),
                split_metric(split, "gray_error", "mean absolute grey error", headline=True, bar="gray")]

    def decode(self, predictions):
        return predictions

    def render(self, targets):  # (B, K, 1) -> (B, K, P*P*3)
        grey = ((targets * 0.5 + 0.5) * 255).clamp(0, 255).to(torch.uint8)
        return grey.expand(-1, -1, 3 * self.patch_size ** 2)


GRAY = TargetEntry(MeanGray, "its mean grey level (regressed)", lambda patch_size, mpp: 1, GraySettings)


def test_a_registered_target_is_chosen_by_the_config_and_brings_its_head_loss_metrics_and_panel(monkeypatch):
    monkeypatch.setitem(TARGETS, "gray", GRAY)
    with pytest.raises(ConfigError, match="Input should be 'color', 'color4x4', 'pixels' or 'gray' \\(got 'grey'\\)"):
        load_config(None, [*TINY, "mpp.target=grey"])
    objective = pretrain.build_objective(load_config(None, [*TINY, "mpp.target=gray", "mpp.gray_gamma=2"]), None)
    assert objective.head.out_features == 1 and objective.target.gamma == 2
    with pytest.raises(ConfigError, match="'mpp.gray_gamma': Input should be greater than 0"):
        load_config(None, [*TINY, "mpp.target=gray", "mpp.gray_gamma=0"])
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    out = objective(images)
    out.loss.backward()
    assert torch.isfinite(out.loss) and set(out.metrics) == {"gray_error"}
    panel = objective.panel(images)
    assert set(panel) == {"crops", "corrupted", "target", "predicted"}
    assert all(v.shape == (2, 3, 16, 16) and v.dtype == torch.uint8 for v in panel.values())
    assert torch.all(panel["target"][:, 0] == panel["target"][:, 2])  # grey: the target row has R = B


def test_a_registered_target_shows_everywhere(tmp_path, make_shards, monkeypatch, capsys):
    # One class and one TARGETS entry: its metrics charted, HParams columns, in the progress bar and results.json, its
    # description on the model card.
    monkeypatch.setitem(TARGETS, "gray", GRAY)
    make_shards([40], size=32)
    pretrain.run(load_config(None, [f"data.shards={tmp_path / 'shards'}", f"output_dir={tmp_path / 'run'}", *TINY,
                                    "mpp.target=gray", "mpp.gray_gamma=0.5", "train.steps=4", "train.warmup_steps=1",
                                    "train.batch_size=8", "log.every=2"]))
    shows = where_metrics_show(tmp_path / "run", "pretrain")
    # Its own setting: in the config reference (--help and docs/reference.md), an HParams column, config.yaml.
    assert ("mpp.gray_gamma", "1.0", GraySettings.model_fields["gray_gamma"].description) in config_reference()
    assert "mpp.gray_gamma" in shows["columns"] and shows["values"]["mpp.gray_gamma"] == "0.5"  # as written
    assert load_config(tmp_path / "run" / "config.yaml").mpp.gray_gamma == 0.5
    assert "mpp.target" in [key for key, _, meaning in config_reference() if "gray, its mean grey level" in meaning]
    assert shows["charts"]["training"] == ["train/pretext_loss", "train/gray_error"]
    assert {"train/pretext_loss", "train/gray_error"} <= set(shows["hparams"]) and "train/gray_error" in shows["results"]["final"]
    assert "gray=" in capsys.readouterr().err  # the progress bar
    card = exported_card(tmp_path / "run", tmp_path / "hf")
    assert MeanGray.description in card and "train/gray_error " in card
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    assert "mpp.gray_gamma = 1.0" in capsys.readouterr().out


def test_each_target_keeps_its_head_size_and_metrics():
    for name, outputs, metrics in (("color", 512, {"color_acc", "color_acc_prior"}),
                                   ("color4x4", 16 * 512, {"color_acc", "color_acc_prior"}),
                                   ("pixels", 3 * 4 * 4, {"pretext_loss_prior"})):
        objective = pretrain.build_objective(load_config(None, [*TINY, f"mpp.target={name}"]), None)
        assert objective.head.out_features == outputs
        assert set(objective(torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)).metrics) == metrics, name


def test_each_registry_entry_names_a_part_that_agrees_with_it():
    # The registries describe the parts without loading torch (the config checks a head's size from the entry); the
    # part the entry names is imported when a run builds it, and must be what the entry says.
    from mpp.model.registry import OBJECTIVES, implementation
    from pipelines.evaluations.registry import EVALUATORS

    for name, entry in TARGETS.items():
        for patch_size, bits in [(4, 3), (8, 2), (16, 1)]:
            settings = load_config(None, [f"mpp.target={name}", f"mpp.color_bits={bits}"]).mpp
            assert entry.build(patch_size, settings).outputs == entry.outputs(patch_size, settings), (name, patch_size, bits)
    with pytest.raises(ValueError, match="model.patch_size must be divisible by 4, got 6"):
        TARGETS["color4x4"].outputs(6, None)
    assert all(callable(implementation(kind.build)) for kind in OBJECTIVES.values())
    assert all(callable(implementation(registration.build)) for registration in EVALUATORS.values())
