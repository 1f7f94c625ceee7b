"""Fine-tuning from weights whose metadata records their architecture: what the file says and the config leaves
unset is taken from the file, as the head count is, rather than refused as a mismatch with a default."""

import json

from safetensors import safe_open

import launch
from mpp.config import load_config
from mpp.model.checkpoint import save_weights
from mpp.model.objectives import masked_patch_prediction
from mpp.model.vit import build_backbone

from conftest import TINY


def test_finetuning_takes_the_position_embeddings_its_weights_record(tmp_path, make_shards, capsys):
    cfg = load_config(None, [*TINY, "model.pos_embed=sincos_2d"])
    (tmp_path / "pre").mkdir()
    save_weights(masked_patch_prediction(build_backbone(cfg.model), cfg, None), tmp_path / "pre" / "model.safetensors")
    make_shards([20, 20], size=32)
    common = ["finetune", "--ckpt", str(tmp_path / "pre"), f"data.shards={tmp_path / 'shards'}",
              f"data.val_shards={tmp_path / 'shards'}", *TINY, "model.image_size=32", "train.steps=2",
              "train.warmup_steps=1", "train.batch_size=8", "finetune.eval_every=2"]
    # At another resolution, model.pos_embed not named: was refused (`set model.pos_embed=sincos_2d`), the file says it.
    assert launch.main([*common, f"output_dir={tmp_path / 'ft'}"]) == 0
    assert "pos_embed: sincos_2d" in (tmp_path / "ft" / "config.yaml").read_text()
    with safe_open(str(tmp_path / "ft" / "model.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["mpp"])["pos_embed"] == "sincos_2d"
    capsys.readouterr()
    # Named otherwise, it is still refused: the user asked for a kind the weights do not have.
    assert launch.main([*common, "model.pos_embed=learned", f"output_dir={tmp_path / 'ft-learned'}"]) == 2
    assert "holds a ViT with model.pos_embed=sincos_2d but the config says model.pos_embed=learned" in capsys.readouterr().err
