"""The zoo without the lab: `pip install keras-vitnorm` and nothing else.

A child process imports `keras_vitnorm` and uses the zoo as a model user does (every
norm, stem and block style in a ViT, presets, `save_to_preset`/`from_preset` with a
resampled position embedding, `load_checkpoint` of a timm file, the `convert`
command), while import hooks refuse the lab's dependencies to the package, as a
models-only install lacks them, and record every try (an import statement of the
package's, or importlib called from it). The test fails if the zoo
tries one, or imports a lab module. Keras' own optional imports (Pillow, TensorFlow
where installed) are Keras', not the package's, and pass.

In the full test environment this checks the zoo's code paths; `.ci/run` also runs it
in a fresh environment with one backend and no extras, where the train command must
say which extra to install.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import keras

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Top-level modules of the lab's dependencies (the train and study extras).
LAB_DEPENDENCIES = ("matplotlib", "PIL", "scipy", "sklearn", "tensorboard", "tensorflow_datasets")
LAB_MODULES = ("keras_vitnorm.training", "keras_vitnorm.study", "keras_vitnorm.analysis",
               "keras_vitnorm.host_memory", "keras_vitnorm.framework_logs")

SCRIPT = """
import importlib.util, json, os, pathlib, sys, tempfile

LAB = set({lab!r}) | ({{"tensorflow"}} if os.environ["KERAS_BACKEND"] != "tensorflow" else set())
PACKAGE = str(pathlib.Path({root!r}) / "keras_vitnorm")
IMPORT_MACHINERY = os.path.dirname(importlib.util.__file__)
tried = []

class RefuseTheLab:
    # Refuses (and records) a lab dependency that the package asks for by importlib.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in LAB:
            return None
        frame = sys._getframe(1)
        while frame and (frame.f_code.co_filename.startswith(("<frozen", IMPORT_MACHINERY))
                         or frame.f_code.co_filename == "<string>"):
            if frame.f_globals.get("__name__") == "importlib.util":
                return None  # importlib.util.find_spec: whether it is installed, not an import
            frame = frame.f_back
        if frame and frame.f_code.co_filename.startswith(PACKAGE):
            tried.append(f"{{name}} from {{frame.f_code.co_filename}}:{{frame.f_lineno}}")
            raise ModuleNotFoundError(f"No module named {{name!r}} (a lab dependency)")
        return None

sys.meta_path.insert(0, RefuseTheLab())
import builtins
keras_import = builtins.__import__

def refuse_the_lab(name, globals=None, locals=None, fromlist=(), level=0):
    # An import statement of the package's, even of a module something else imported.
    importer = (globals or {{}}).get("__name__", "")
    if level == 0 and name.split(".")[0] in LAB and importer.startswith("keras_vitnorm"):
        tried.append(f"{{name}} from {{importer}}")
        raise ModuleNotFoundError(f"No module named {{name!r}} (a lab dependency)")
    return keras_import(name, globals, locals, fromlist, level)

builtins.__import__ = refuse_the_lab

import keras
import numpy as np
import keras_vitnorm
from keras_vitnorm import ViT

tiny = dict(image_size=16, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, num_classes=3)
images = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
variants = [
    dict(stem="dual_patchnorm", norm="rmsnorm", qk_norm=True, layer_scale=0.1),
    dict(stem="conv", norm="batchnorm", block_style="normformer", pooling="gap"),
    dict(stem="post_posemb", norm="dyt", block_style="deepnorm"),
    dict(stem="pre_patchnorm", norm="groupnorm", norm_groups=4, block_style="sub_ln"),
    dict(stem="post_patchnorm", stem_norm="affine", norm="identity", attn_norm="pre_post",
         weight_standardization=True),
]
for variant in variants:
    assert np.isfinite(keras.ops.convert_to_numpy(ViT(**tiny, **variant)(images))).all(), variant

assert "s16_dpn" in keras_vitnorm.list_presets()
model = ViT.from_preset("ti16_dpn", **tiny)
with tempfile.TemporaryDirectory() as folder:
    model.save_to_preset(os.path.join(folder, "preset"))
    bigger = ViT.from_preset(os.path.join(folder, "preset"), image_size=24)
    assert bigger.get_layer("stem").pos_embedding.shape == (1, 1 + 36, 16)

    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    shapes = {{
        "patch_embed.proj.weight": (16, 3, 4, 4), "patch_embed.proj.bias": (16,),
        "cls_token": (1, 1, 16), "pos_embed": (1, 17, 16), "norm.weight": (16,), "norm.bias": (16,),
        "head.weight": (3, 16), "head.bias": (3,),
        "blocks.0.norm1.weight": (16,), "blocks.0.norm1.bias": (16,),
        "blocks.0.attn.qkv.weight": (48, 16), "blocks.0.attn.qkv.bias": (48,),
        "blocks.0.attn.proj.weight": (16, 16), "blocks.0.attn.proj.bias": (16,),
        "blocks.0.norm2.weight": (16,), "blocks.0.norm2.bias": (16,),
        "blocks.0.mlp.fc1.weight": (32, 16), "blocks.0.mlp.fc1.bias": (32,),
        "blocks.0.mlp.fc2.weight": (16, 32), "blocks.0.mlp.fc2.bias": (16,),
    }}
    timm_file = os.path.join(folder, "vit_tiny.safetensors")
    save_file({{k: rng.normal(size=s).astype("float32") for k, s in shapes.items()}}, timm_file)
    loaded, report = keras_vitnorm.load_checkpoint(timm_file, num_heads=2, stem="dual_patchnorm")
    assert report.format == "timm" and len(report.loaded) == len(shapes), report
    assert np.isfinite(keras.ops.convert_to_numpy(loaded(images))).all()
    lab_modules = sorted(m for m in sys.modules if m.startswith({lab_modules!r}))

    from keras_vitnorm import cli
    converted = os.path.join(folder, "converted")
    convert_exit = cli.main(["convert", timm_file, converted, "--num-heads", "2"])
    assert ViT.from_preset(converted).count_params() == sum(np.prod(s) for s in shapes.values())
    train_exit = cli.main(["train"]) if importlib.util.find_spec("sklearn") is None else None

print(json.dumps({{"tried": tried, "lab_modules": lab_modules, "convert_exit": convert_exit,
                  "train_exit": train_exit}}))
"""


def test_the_zoo_works_without_the_lab_and_never_asks_for_it():
    code = SCRIPT.format(lab=LAB_DEPENDENCIES, root=str(ROOT), lab_modules=LAB_MODULES)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "KERAS_BACKEND": keras.backend.backend()}, timeout=600)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["tried"] == [] and outcome["lab_modules"] == []
    assert outcome["convert_exit"] == 0
    if outcome["train_exit"] is not None:  # the lab is not installed: the CLI names the extra
        assert outcome["train_exit"] == 2
        assert "pip install 'keras-vitnorm[train]'" in result.stderr
