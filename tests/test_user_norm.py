"""A user's own normalization layer, registered under a name (`register_norm`), in every
slot a built-in norm takes: the block norms in each placement and block style, QK-norm,
Dual PatchNorm's two stem norms and the final norm; trained, saved and reloaded
(`.keras`, presets), named clearly where its class is not registered, and given by name
on the command line through `KERAS_VITNORM_NORM_MODULES`. Keras' layer harness runs on it
in tests/test_keras_harness.py."""

import os
import re

import keras
import numpy as np
import pytest

import keras_vitnorm
from keras_vitnorm import cli
from keras_vitnorm.layers import normalization
from keras_vitnorm.layers import register_norm
from test_training import TINY_ARGV
from user_norm import ScaleNorm

MODULE_PATH = os.path.join(os.path.dirname(__file__), "user_norm.py")
TINY = {"image_size": 16, "patch_size": 4, "width": 16, "depth": 2, "num_heads": 2,
        "mlp_dim": 32, "num_classes": 3}


def _scale_norms(model):
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, ScaleNorm)]


@pytest.mark.parametrize("attn_norm, mlp_norm, block_style", [
    ("pre", "pre", "standard"), ("post", "post", "standard"), ("pre_post", "none", "standard"),
    ("pre", "pre", "normformer"), ("pre", "pre", "sub_ln"), (None, None, "deepnorm")])
def test_a_user_norm_in_every_slot_trains_saves_and_reloads(tmp_path, attn_norm, mlp_norm,
                                                           block_style):
    # QK-norm where a gain before it still reaches the loss: a scale-invariant ScaleNorm
    # on q and k, and on the values' path (pre_post's N2, NormFormer's and Sub-LN's norms),
    # would leave the attention norm's gain with no gradient, as it would a LayerNorm's.
    qk_norm = attn_norm != "pre_post" and block_style in ("standard", "deepnorm")
    model = keras_vitnorm.ViT(**TINY, norm="scalenorm", stem="dual_patchnorm",
                              stem_norm="scalenorm", qk_norm=qk_norm, attn_norm=attn_norm,
                              mlp_norm=mlp_norm, block_style=block_style, final_norm=True)
    # Per block: the placement's norms, two for QK-norm, NormFormer's and Sub-LN's extras;
    # two in the stem and the final norm.
    placement = {"pre": 1, "post": 1, "pre_post": 2, "none": 0, None: 1}
    extra = {"standard": 0, "deepnorm": 0, "normformer": 2, "sub_ln": 2}[block_style]
    per_block = placement[attn_norm] + placement[mlp_norm] + 2 * qk_norm + extra
    assert len(_scale_norms(model)) == TINY["depth"] * per_block + 3
    images = np.random.default_rng(0).uniform(-1, 1, (8, 16, 16, 3)).astype("float32")
    labels = np.arange(8) % 3
    model.compile(keras.optimizers.AdamW(1e-2), "sparse_categorical_crossentropy")
    # Every gain but the stem's first: Dual PatchNorm's second norm, a ScaleNorm too, makes
    # the loss blind to the scale of the first one's output.
    trained = [norm for norm in _scale_norms(model) if not norm.path.endswith("patch_norm")]
    gains = [float(keras.ops.convert_to_numpy(norm.g)) for norm in trained]
    model.fit(images, labels, batch_size=8, epochs=1, verbose=0)
    moved = [float(keras.ops.convert_to_numpy(norm.g)) for norm in trained]
    assert len(trained) == len(_scale_norms(model)) - 1
    assert all(a != b for a, b in zip(gains, moved)), "a ScaleNorm gain received no gradient"
    expected = keras.ops.convert_to_numpy(model(images))
    model.save(tmp_path / "model.keras")
    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(reloaded(images)), expected, atol=1e-6)
    model.save_to_preset(tmp_path / "preset")
    from_preset = keras_vitnorm.ViT.from_preset(str(tmp_path / "preset"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(from_preset(images)), expected, atol=1e-6)


def test_a_model_whose_norm_is_not_registered_names_it_and_loads_once_it_is(tmp_path, monkeypatch):
    keras_vitnorm.ViT(**TINY, norm="scalenorm").save(tmp_path / "model.keras")
    registry = keras.saving.get_custom_objects()
    monkeypatch.delitem(registry, "keras_vitnorm.norms>scalenorm")
    monkeypatch.delenv(normalization.NORM_MODULES_VARIABLE, raising=False)
    monkeypatch.setattr(normalization, "_imported_entries", set())
    with pytest.raises(ValueError, match=r"Unknown norm='scalenorm'.*register_norm.*"
                       r"KERAS_VITNORM_NORM_MODULES"):
        keras.saving.load_model(tmp_path / "model.keras")
    # The modules the variable lists are imported the first time a name is missing.
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    monkeypatch.setattr(normalization, "_imported_entries", set())
    assert keras.saving.load_model(tmp_path / "model.keras").get_config()["norm"] == "scalenorm"


def test_a_module_the_variable_lists_later_in_the_process_is_imported(monkeypatch):
    # A process that imported the variable's modules once (a test run, a notebook)
    # still finds a module listed later.
    slow_norm = os.path.join(os.path.dirname(__file__), "slow_norm.py")
    monkeypatch.delitem(keras.saving.get_custom_objects(), "keras_vitnorm.norms>slow_layernorm",
                        raising=False)
    monkeypatch.setattr(normalization, "_imported_entries", set())  # a fresh process
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    assert "scalenorm" in normalization.registered_norms(import_modules=True)
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, f"{MODULE_PATH},{slow_norm}")
    assert "slow_layernorm" in normalization.registered_norms(import_modules=True)


def test_register_norm_refuses_built_in_names_clashes_and_non_layers():
    with pytest.raises(ValueError, match="'rmsnorm' is a built-in norm"):
        register_norm("rmsnorm", ScaleNorm)
    with pytest.raises(ValueError, match="already registered to ScaleNorm"):
        register_norm("scalenorm", keras.layers.LayerNormalization)
    with pytest.raises(TypeError, match="keras.layers.Layer subclass"):
        register_norm("plain", object)
    with pytest.raises(ValueError, match="letters, digits and underscores"):
        register_norm("scale norm", ScaleNorm)
    with pytest.raises(ValueError, match="stem_norm_learnable=False"):
        keras_vitnorm.ViT(**TINY, stem="dual_patchnorm", stem_norm="scalenorm",
                          stem_norm_learnable=False)


# The command line's lookup of a registered name; the norm on each backend is
# test_a_user_norm_in_every_slot_trains_saves_and_reloads's.
@pytest.mark.one_backend
def test_the_command_line_takes_a_registered_norm_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    status = cli.main(["train", *TINY_ARGV, "--norm", "scalenorm", "--stem", "dual_patchnorm",
                       "--stem-norm", "scalenorm", "--verbose", "0",
                       "--output-dir", str(tmp_path / "run")])
    assert status == 0
    model = keras_vitnorm.ViT.from_preset(str(tmp_path / "run" / "preset"))
    assert (model.get_config()["norm"], model.get_config()["stem_norm"]) == ("scalenorm",) * 2
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", *TINY_ARGV, "--norm", "scalenrom", "--output-dir", str(tmp_path / "x")])
    assert stopped.value.code == 2
    assert "Did you mean 'scalenorm'?" in capsys.readouterr().err


STUDY_ARGV = ["--seeds", "0", "1", "--image-size", "16", "--patch-size", "4", "--width", "16",
              "--depth", "1", "--num-heads", "2", "--mlp-dim", "32", "--steps", "2",
              "--batch-size", "32", "--warmup-steps", "1", "--verbose", "0"]
VARIANTS = """
[study]
name = "my_norms"
baseline = "layernorm"

[variants.layernorm]

[variants.scalenorm]
model = { norm = "scalenorm", stem = "dual_patchnorm", stem_norm = "scalenorm" }
train = { learning_rate = 0.002 }
"""


# The variants file's study; the norm on each backend is
# test_a_user_norm_in_every_slot_trains_saves_and_reloads's.
@pytest.mark.one_backend
def test_a_two_variant_study_from_a_variants_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    (tmp_path / "study.toml").write_text(VARIANTS)
    argv = ["ablate", "--variants-file", str(tmp_path / "study.toml"),
            "--output-dir", str(tmp_path / "s"), *STUDY_ARGV]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "s" / "my_norms.md").read_text()
    # Both variants, two seeds each, the difference from the baseline with its interval.
    assert "| scalenorm |" in table and "| layernorm |" in table
    assert "my_norms" in out
    for variant in ("layernorm", "scalenorm"):
        for seed in (0, 1):
            assert (tmp_path / "s" / "my_norms" / variant / f"seed_{seed}" / "metrics.json").exists()
    trained = keras_vitnorm.ViT.from_preset(str(tmp_path / "s" / "my_norms" / "scalenorm" /
                                                 "seed_0" / "preset"))
    assert trained.get_config()["norm"] == "scalenorm"
    # The same command again finds every run finished and trains nothing.
    metrics = sorted((tmp_path / "s" / "my_norms").glob("*/seed_*/metrics.json"))
    written = [path.stat().st_mtime_ns for path in metrics]
    assert cli.main(argv) == 0
    assert [path.stat().st_mtime_ns for path in metrics] == written
    assert capsys.readouterr().out == out


SWEEP = """
[variants.layernorm]

[variants.scalenorm]
model = { norm = "scalenorm" }
lr_sweep = [0.001, 0.002]
"""


@pytest.mark.one_backend
def test_a_variant_of_the_file_sweeps_its_own_rates_and_trains_its_seeds_at_the_best(
        tmp_path, monkeypatch, capsys):
    # Each sweep run is finished by hand (validation accuracy higher at 0.002): the plan
    # asks first for scalenorm at both of its rates and layernorm at its one rate (the
    # base's 0.001), then for the second seed of each at its rate.
    from keras_vitnorm import durable
    from keras_vitnorm.study import plan as plan_lib

    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    (tmp_path / "study.toml").write_text(SWEEP)
    study = tmp_path / "s"
    argv = ["ablate", "--variants-file", str(tmp_path / "study.toml"), "--plan",
            "--learning-rate", "0.001", "--output-dir", str(study), *STUDY_ARGV]

    def plan():
        assert cli.main(argv) == 0
        commands = (study / "plan" / "commands.txt").read_text().split("\n")
        return sorted(os.path.relpath(plan_lib.read_job(c.split()[-1])["run_dir"], study)
                      for c in commands if c.strip())

    def finish(run_dir):
        rate = float(run_dir.split("lr_")[1].split(os.sep)[0])
        durable.write_json(str(study / run_dir / "metrics.json"),
                           {"status": "completed", "val_accuracy": 0.3 + 100 * rate,
                            "test_accuracy": 0.5, "steps": 2})

    sweep = [os.path.join("study", "layernorm", "lr_0.001", "seed_0"),
             os.path.join("study", "scalenorm", "lr_0.001", "seed_0"),
             os.path.join("study", "scalenorm", "lr_0.002", "seed_0")]
    assert plan() == sweep
    for run_dir in sweep:
        os.makedirs(study / run_dir)
        finish(run_dir)
    assert plan() == [os.path.join("study", "layernorm", "lr_0.001", "seed_1"),
                      os.path.join("study", "scalenorm", "lr_0.002", "seed_1")]
    table = (study / "study_lr_selection.md").read_text().splitlines()
    assert table[0].startswith("| variant | lr 0.001 | lr 0.002 | chosen rate |")
    assert table[2].startswith("| layernorm | 40.00 |  | 0.001 (its only rate) |")
    assert table[3].startswith("| scalenorm | 40.00 | 50.00 | 0.002 (edge of the grid) |")


@pytest.mark.parametrize("text, message", [
    ("[variants.a]\nmodel = { norm = 'scalenrom' }\n",
     r"variant 'a': Unknown norm='scalenrom'\. Did you mean 'scalenorm'\?"),
    ("[variants.a]\nmodel = { nrom = 'rmsnorm' }\n",
     r"Unknown model key of variant 'a' in .*study.toml 'nrom'\. Did you mean 'norm'\?"),
    ("[variants.a]\n[variants.b]\ntrain = { learning_rte = 1e-3 }\n",
     r"Unknown train key of variant 'b' .*'learning_rte'"),
    ("[variants.a]\ntrain = { learning_rate = -1 }\n", r"variant 'a': .*learning_rate"),
    ("[study]\nbaseline = 'c'\n[variants.a]\n", r"baseline 'c' is not one of its variants \(a\)"),
    ("[study]\nname = 'stems'\n[variants.a]\n", r"cannot be named 'stems'"),
    ("[variant.a]\n", r"Unknown table in .*study.toml 'variant'\. Did you mean 'variants'\?"),
    ("[variants.a\n", r"is not TOML"),
    ("[variants.a]\nlr_sweep = [1e-3, 2e-3]\ntrain = { learning_rate = 1e-3 }\n",
     r"variant 'a' sets both train.learning_rate and lr_sweep"),
    ("[variants.a]\nlr_sweep = [1e-3]\n", r"variant 'a': a learning-rate sweep needs two"),
    ("[variants.a]\nlr_sweep = ['fast', 1e-3]\n", r"variant 'a': .*positive numbers, got 'fast'"),
    ("[variants.a]\nlr_seep = [1e-3, 2e-3]\n", r"'lr_seep'\. Did you mean 'lr_sweep'\?"),
])
def test_a_bad_variants_file_is_named_before_anything_trains(tmp_path, monkeypatch, capsys,
                                                              text, message):
    monkeypatch.setenv(normalization.NORM_MODULES_VARIABLE, MODULE_PATH)
    (tmp_path / "study.toml").write_text(text)
    status = cli.main(["ablate", "--variants-file", str(tmp_path / "study.toml"),
                       "--output-dir", str(tmp_path / "s"), *STUDY_ARGV])
    assert status == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "s").exists()
