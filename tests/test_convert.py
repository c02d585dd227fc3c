"""Checkpoint converters: parity with the reference implementations, resampling,
fine-tuning into variants, errors and the convert command (export: tests/test_deploy.py).

The reference for the Hugging Face, timm and big_vision formats is transformers'
`ViTForImageClassification` (a Ti/16 at 224 with random weights, every parameter
perturbed so that no LayerNorm is the identity): its state dict is saved as
transformers does, and rewritten in timm's and big_vision/AugReg's key layouts. The
keras-hub reference is keras-hub's own `ViTImageClassifier`.
"""

import json
import os
import re
import shutil
import sys

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import cli
from keras_vitnorm.models import load_checkpoint
from keras_vitnorm.convert import read_checkpoint
from keras_vitnorm.training import TrainConfig
from test_model import big_vision_resample  # big_vision's resample_posemb (scipy zoom)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
from reference_checkpoints import TI, perturbed, to_big_vision, to_timm  # noqa: E402

torch = pytest.importorskip("torch", reason="the Hugging Face reference ViT runs on PyTorch")
transformers = pytest.importorskip("transformers", reason="the reference ViT is transformers'")

TOLERANCE = 1e-4
@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).uniform(-1, 1, (2, 224, 224, 3)).astype("float32")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, images):
    """A saved transformers ViT, its state dict as NumPy and its logits on `images`."""
    model = perturbed(transformers.ViTForImageClassification(transformers.ViTConfig(**TI)), 0)
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory)
    with torch.no_grad():
        logits = model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits.numpy()
    from safetensors.numpy import load_file

    state = load_file(str(directory / "model.safetensors"))
    return {"dir": str(directory), "state": state, "logits": logits, "model": model}


def logits_of(model, images):
    return keras.ops.convert_to_numpy(model(images))


def assert_parity(model, images, expected):
    error = float(np.max(np.abs(logits_of(model, images) - expected)))
    assert error < TOLERANCE, f"max |logit difference| {error:.2e} on {keras.backend.backend()}"


# ------------------------------------------------------------------------------- parity


def test_huggingface_directory_matches_transformers(reference, images, capsys):
    model = ViT.from_preset(reference["dir"])
    assert "huggingface format" in capsys.readouterr().out  # the detected format is reported
    assert model.get_config()["norm_epsilon"] == 1e-6 and model.count_params() == 5_526_346
    assert_parity(model, images, reference["logits"])


def test_huggingface_in_memory_vitmodel_matches_its_features(reference, images):
    from keras_vitnorm.models import build_from_checkpoint
    from keras_vitnorm.convert import huggingface

    backbone = reference["model"].vit  # ViTModel without pooler; module key naming
    vit_model = transformers.ViTModel(transformers.ViTConfig(**TI))  # has a pooler
    vit_model.load_state_dict(backbone.state_dict(), strict=False)
    vit_model.eval()
    checkpoint = huggingface.convert(vit_model.state_dict(), vit_model.config)
    assert any("pooler" in entry for entry in checkpoint.ignored)
    model, report = build_from_checkpoint(checkpoint, ViT)
    assert model.get_config()["num_classes"] == 0 and not report.new
    with torch.no_grad():
        hidden = vit_model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).last_hidden_state
    assert_parity(model, images, hidden[:, 0].numpy())


def test_timm_state_dict_matches(reference, images, tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "vit_tiny_patch16_224.safetensors")
    save_file(to_timm(reference["state"]), path)
    model, report = load_checkpoint(path)
    assert report.format == "timm" and len(report.loaded) == 152 and not report.new
    assert_parity(model, images, reference["logits"])
    pth = str(tmp_path / "vit.pth")
    torch.save({"model": {k: torch.from_numpy(v) for k, v in to_timm(reference["state"]).items()}}, pth)
    assert_parity(load_checkpoint(pth)[0], images, reference["logits"])


@pytest.mark.parametrize("naming", ["augreg", "big_vision", "big_vision_scanned"])
def test_big_vision_npz_matches(reference, images, tmp_path, naming):
    path = str(tmp_path / f"{naming}.npz")
    np.savez(path, **to_big_vision(reference["state"], naming))
    model, report = load_checkpoint(path)
    assert report.format == "big_vision" and model.get_config()["num_heads"] == 3
    expected = reference["logits"]
    if naming != "augreg":  # big_vision gives the class token no position embedding
        hf = reference["model"]
        saved = hf.vit.embeddings.position_embeddings.detach().clone()
        with torch.no_grad():
            hf.vit.embeddings.position_embeddings[:, 0] = 0
            expected = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits.numpy()
            hf.vit.embeddings.position_embeddings.copy_(saved)
    assert_parity(model, images, expected)


def test_keras_hub_preset_matches_keras_hub(tmp_path, images, monkeypatch):
    keras_hub = pytest.importorskip("keras_hub", reason="the reference is keras-hub's ViT")
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(224, 224, 3), patch_size=16, num_layers=12, num_heads=3, hidden_dim=192,
        mlp_dim=768)
    classifier = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10)
    rng = np.random.default_rng(1)
    for variable in classifier.weights:  # random values everywhere, norms included
        variable.assign(keras.ops.convert_to_numpy(variable) + 0.05 * rng.standard_normal(variable.shape))
    classifier.save_to_preset(str(tmp_path / "hub"))
    expected = keras.ops.convert_to_numpy(classifier(images))
    model, report = load_checkpoint(str(tmp_path / "hub"))
    assert report.format == "keras_hub" and model.get_config()["num_classes"] == 10
    assert_parity(model, images, expected)
    # The same preset by its Kaggle handle, from kagglehub's cache as kagglehub lays it out.
    pytest.importorskip("kagglehub", reason="kaggle:// handles go through kagglehub")
    cache = tmp_path / "kagglehub"
    version_dir = cache / "models" / "keras" / "vit" / "keras" / "tiny_test" / "1"
    shutil.copytree(tmp_path / "hub", version_dir)
    (version_dir.parent / "1.complete").write_text("")
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(cache))
    assert_parity(ViT.from_preset("kaggle://keras/vit/keras/tiny_test/1"), images, expected)
    features = keras.ops.convert_to_numpy(backbone(images))[:, 0]
    backbone_dir = str(tmp_path / "backbone")
    backbone.save_to_preset(backbone_dir)
    assert_parity(ViT.from_preset(backbone_dir), images, features)


# --------------------------------------------------------------- resampling, variants


def timm_resample(source, new_h, new_w):
    """timm's `resample_abs_pos_embed` defaults on a `(h*w, d)` grid, as timm computes it."""
    side = int(round(len(source) ** 0.5))
    grid = torch.from_numpy(source).reshape(1, side, side, -1).permute(0, 3, 1, 2)
    resized = torch.nn.functional.interpolate(
        grid, size=(new_h, new_w), mode="bicubic", antialias=True
    )
    return resized.permute(0, 2, 3, 1).reshape(new_h * new_w, -1).numpy()


def test_position_embedding_resampled_224_to_384(reference):
    model, report = load_checkpoint(reference["dir"], image_size=384)
    assert report.resampled == ["stem/position_embedding (14x14 -> 24x24 grid, bilinear)"]
    out = logits_of(model, np.random.default_rng(2).uniform(-1, 1, (1, 384, 384, 3)).astype("float32"))
    assert out.shape == (1, 10) and np.all(np.isfinite(out))
    source = reference["state"]["vit.embeddings.position_embeddings"][0]
    got = keras.ops.convert_to_numpy(model.get_layer("stem").pos_embedding)[0]
    np.testing.assert_array_equal(got[0], source[0])  # the class position is kept
    expected = big_vision_resample(source[1:].reshape(14, 14, -1), 24, 24).reshape(576, -1)
    np.testing.assert_allclose(got[1:], expected, atol=1e-6)


@pytest.mark.parametrize("image_size", [384, 160, [96, 320]])
def test_bicubic_resampling_matches_timm(reference, image_size):
    model, report = load_checkpoint(reference["dir"], image_size=image_size, resample="bicubic")
    assert report.resampled[0].endswith(", bicubic)")
    source = reference["state"]["vit.embeddings.position_embeddings"][0]
    got = keras.ops.convert_to_numpy(model.get_layer("stem").pos_embedding)[0]
    np.testing.assert_array_equal(got[0], source[0])
    grid = model.get_layer("stem").grid_size
    np.testing.assert_allclose(got[1:], timm_resample(source[1:], *grid), atol=2e-6)


def test_resample_methods_differ_and_the_cli_offers_both(reference, tmp_path):
    """Both rules are reachable from `convert`; they are different rules (up to 0.1 apart
    here), so the choice matters."""
    for method in ("bilinear", "bicubic"):
        code = cli.main(["convert", reference["dir"], str(tmp_path / method), "--image-size", "384",
                         "--resample", method])
        assert code == 0
    embeddings = [
        keras.ops.convert_to_numpy(ViT.from_preset(str(tmp_path / m)).get_layer("stem").pos_embedding)
        for m in ("bilinear", "bicubic")
    ]
    assert np.abs(embeddings[0] - embeddings[1]).max() > 1e-2


def test_fine_tune_into_dual_patchnorm_reports_new_weights(reference):
    model, report = load_checkpoint(reference["dir"], stem="dual_patchnorm", num_classes=5)
    new = sorted(entry.split(" ")[0] for entry in report.new)
    assert new == ["head/bias", "head/kernel", "stem/embedding_norm/beta", "stem/embedding_norm/gamma",
                   "stem/patch_norm/beta", "stem/patch_norm/gamma"]
    assert "stem/patch_norm/gamma (ones)" in report.new and "stem/patch_norm/beta (zeros)" in report.new
    assert len(report.loaded) == 150
    assert sorted(report.dropped) == [("classifier.bias", "num_classes 10 -> 5: a new head"),
                                      ("classifier.weight", "num_classes 10 -> 5: a new head")]
    weights = model.weights_by_path()
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(weights["block_3/mlp/fc1/kernel"]),
        reference["state"]["vit.encoder.layer.3.intermediate.dense.weight"].T)


def test_fine_tune_into_rmsnorm_keeps_the_layernorm_scales(reference, images):
    model, report = load_checkpoint(reference["dir"], norm="rmsnorm")
    assert len(report.converted) == 25 and not report.new  # 2 norms x 12 blocks + final
    assert len(report.dropped) == 25 and all("replaces the layernorm layers" in why for _, why in report.dropped)
    scale = keras.ops.convert_to_numpy(model.weights_by_path()["final_norm/scale"])
    np.testing.assert_array_equal(scale, reference["state"]["vit.layernorm.weight"])
    assert np.all(np.isfinite(logits_of(model, images)))
    _, dyt = load_checkpoint(reference["dir"], norm="dyt")
    assert not dyt.converted and sum("block_0/attn_norm" in e for e in dyt.new) == 3  # alpha, gamma, beta


# ------------------------------------------------------------------------------- errors


def test_architecture_override_is_refused_with_the_key(reference):
    with pytest.raises(ValueError, match=r"Override width=384 does not fit the checkpoint, which has "
                       r"width=192 \(e.g. key 'vit.embeddings.patch_embeddings.projection.bias'"):
        load_checkpoint(reference["dir"], width=384)


def test_wrong_or_incomplete_checkpoints_name_the_key(reference, tmp_path):
    from safetensors.numpy import save_file

    timm_state = to_timm(reference["state"])
    missing = dict(timm_state)
    del missing["blocks.7.norm2.bias"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="has no key 'blocks.7.norm2.bias'"):
        read_checkpoint(str(tmp_path / "missing.safetensors"))
    wider = dict(timm_state)
    wider["blocks.4.mlp.fc1.weight"] = np.zeros((1536, 192), "float32")
    save_file(wider, str(tmp_path / "wider.safetensors"))
    with pytest.raises(ValueError, match=r"Key 'blocks.4.mlp.fc1.weight' .* has shape \(1536, 192\); "
                       r".* expects \(768, 192\)"):
        read_checkpoint(str(tmp_path / "wider.safetensors"))
    cnn = {"conv1.weight": np.zeros((64, 3, 7, 7), "float32"), "fc.weight": np.zeros((10, 64), "float32")}
    save_file(cnn, str(tmp_path / "resnet.safetensors"))
    with pytest.raises(ValueError, match=r"not a ViT checkpoint .* first key found is 'conv1.weight' "
                       r"with shape \(64, 3, 7, 7\)"):
        ViT.from_preset(str(tmp_path / "resnet.safetensors"))
    with pytest.raises(ValueError, match="does not record its head count and width=200"):
        save_file({**timm_state, "patch_embed.proj.weight": np.zeros((200, 3, 16, 16), "float32")},
                  str(tmp_path / "odd.safetensors"))
        read_checkpoint(str(tmp_path / "odd.safetensors"))
    with pytest.raises(ValueError, match="num_heads=6 does not fit: the huggingface checkpoint"):
        load_checkpoint(reference["dir"], num_heads=6)
    (tmp_path / "weights.txt").write_text("nope")
    with pytest.raises(ValueError, match="Unsupported checkpoint file"):
        read_checkpoint(str(tmp_path / "weights.txt"))


# ------------------------------------------------------------------------- hub handles


def hf_cache_entry(cache, repo_id, files):
    """Lays `files` ({name: source path}) out as huggingface_hub caches a repository's main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)


@pytest.fixture
def hf_offline_cache(tmp_path, monkeypatch):
    """huggingface_hub in its offline mode over an empty cache in tmp_path."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hf_handles_load_transformers_and_timm_repositories(reference, images, tmp_path, capsys,
                                                           hf_offline_cache):
    from safetensors.numpy import save_file

    hf_cache_entry(hf_offline_cache, "google/vit-tiny-test", {
        "config.json": os.path.join(reference["dir"], "config.json"),
        "model.safetensors": os.path.join(reference["dir"], "model.safetensors")})
    save_file(to_timm(reference["state"]), str(tmp_path / "timm.safetensors"))
    (tmp_path / "timm.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224",
                                                    "num_classes": 10, "global_pool": "token"}))
    hf_cache_entry(hf_offline_cache, "timm/vit_tiny_patch16_224.test", {
        "config.json": tmp_path / "timm.json", "model.safetensors": tmp_path / "timm.safetensors"})

    assert_parity(ViT.from_preset("hf://google/vit-tiny-test"), images, reference["logits"])
    model, report = load_checkpoint("hf-hub:timm/vit_tiny_patch16_224.test")
    assert report.format == "timm"
    assert_parity(model, images, reference["logits"])
    assert_parity(ViT.from_preset("hf://timm/vit_tiny_patch16_224.test@main"), images, reference["logits"])
    destination = str(tmp_path / "converted")
    assert cli.main(["convert", "hf://google/vit-tiny-test", destination]) == 0
    assert_parity(ViT.from_preset(destination), images, reference["logits"])
    settings = TrainConfig.from_recipe("finetune_384", preset="hf://google/vit-tiny-test")
    assert settings.model == {"image_size": 384}  # a trained model: the recipe's architecture is not applied


def test_bad_or_unavailable_hub_handles_are_named(hf_offline_cache, capsys):
    with pytest.raises(OSError, match="Could not get 'hf://nobody/missing' from the Hugging Face Hub"):
        ViT.from_preset("hf://nobody/missing")
    for handle in ("hf://just-a-name", "hf://a/b/c", "hf://a/b@", "kaggle://keras/vit", "hf-hub:"):
        with pytest.raises(ValueError, match=f"Hub handle '{re.escape(handle)}' is malformed"):
            load_checkpoint(handle)
    assert cli.main(["convert", "hf://nobody/missing", "out"]) == 2
    assert "hf://nobody/missing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="or a hub handle, hf://<owner>/<repo>"):
        ViT.from_preset("no_such_preset")


# ---------------------------------------------------------------------------- command


def test_convert_command_writes_a_preset_and_refuses_to_overwrite(reference, tmp_path, capsys, images):
    destination = str(tmp_path / "ti16_from_hf")
    assert cli.main(["convert", reference["dir"], destination]) == 0
    assert "huggingface format" in capsys.readouterr().out
    with open(os.path.join(destination, "config.json")) as f:
        assert json.load(f)["config"]["num_classes"] == 10
    assert_parity(ViT.from_preset(destination), images, reference["logits"])
    assert cli.main(["convert", reference["dir"], destination]) == 2
    assert "already holds a preset" in capsys.readouterr().err
    assert cli.main(["convert", reference["dir"], destination, "--overwrite", "--num-classes", "3",
                     "--stem", "dual_patchnorm"]) == 0
    assert ViT.from_preset(destination).get_config()["stem"] == "dual_patchnorm"
    assert cli.main(["convert", str(tmp_path / "nothing.npz"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_fine_tunes_a_checkpoint_into_a_dpn_variant(tmp_path, capsys):
    from keras_vitnorm.training import TrainConfig
    from keras_vitnorm.training import train

    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8, num_labels=7)
    perturbed(transformers.ViTForImageClassification(config), 4).save_pretrained(tmp_path / "hf")
    status = cli.main(["train", "--preset", str(tmp_path / "hf"), "--stem", "dual_patchnorm",
                       "--steps", "3", "--warmup-steps", "1", "--batch-size", "16", "--no-tensorboard",
                       "--output-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "huggingface format" in out and "stem/patch_norm/gamma (ones)" in out
    assert "head/kernel (zeros)" in out  # 7 classes -> digits' 10: a new head
    with open(tmp_path / "run" / "metrics.json") as f:
        metrics = json.load(f)
    assert metrics["model_config"]["stem"] == "dual_patchnorm" and metrics["model_config"]["width"] == 32
    with pytest.raises(ValueError, match="Override width=96 does not fit"):
        train(TrainConfig.from_recipe("small", preset=str(tmp_path / "hf"), model={"width": 96},
                                      steps=3, warmup_steps=1, output_dir=str(tmp_path / "r2")),
              verbose=0)

