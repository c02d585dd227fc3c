"""Prints how far each deployment route's outputs are from Keras' (docs/deploy.md).

    for b in jax tensorflow torch; do KERAS_BACKEND=$b python tools/deploy_parity.py; done

For each variant of `deploy_routes.VARIANTS` (the `TINY` ViT: 32x32 images in 8-px
patches, width 32, depth 2, 2 heads, MLP 64, 5 classes, every weight perturbed), and
for the model as it is and then quantized with Keras' `quantize("int8")`, exports the
model by each route of `ROUTES` the backend offers, runs the artifact on the same two
images with the route's own runtime and prints the largest absolute difference from
that Keras model's outputs (TFLite's own int8 quantization from the float model's). A
route that fails prints its error's first line.
"""

import os
import re
import sys
import tempfile
import warnings

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import deploy_routes as routes  # noqa: E402

from keras_vitnorm import ViT  # noqa: E402


def keras_file(model, path, images):
    model.save(path + ".keras")
    return routes.keras_outputs(keras.saving.load_model(path + ".keras"), images)


def preset(model, path, images):
    model.save_to_preset(path)
    return routes.keras_outputs(ViT.from_preset(path), images)


def saved_model(model, path, images):
    model.export(path + ".saved", verbose=False)
    return routes.serve_saved_model(path + ".saved", images)


def tflite(model, path, images, dynamic_range_int8=False):
    flatbuffer = routes.tflite_from_saved_model(path + ".saved", dynamic_range_int8)
    return routes.run_tflite(flatbuffer, images)


def onnx(model, path, images):
    model.export(path + ".onnx", format="onnx", verbose=False)
    return routes.run_onnx(path + ".onnx", images)


def torch_onnx(model, path, images):
    routes.torch_onnx_any_batch(model, images, path + ".dynamo.onnx")
    return routes.run_onnx(path + ".dynamo.onnx", images)


def jax_export(model, path, images):
    return routes.run_jax_export(routes.jax_export(model, images.shape[1:]), images)


SAVED_MODEL, ALL, BOTH = ("jax", "tensorflow"), ("jax", "tensorflow", "torch"), ("float", "int8")
#: `(row, backends, kinds, outputs)`: a route's row, the backends and the model's kinds
#: ("float", "int8") it applies to, and `outputs(model, path, images)`, those of its
#: artifact. The float model's TFLite rows convert the SavedModel of the row before them.
ROUTES = [
    (".keras", ALL, BOTH, keras_file),
    ("preset", ALL, BOTH, preset),
    ("SavedModel", SAVED_MODEL, ("float",), saved_model),
    ("TFLite float", SAVED_MODEL, ("float",), tflite),
    ("TFLite dynamic-range int8 (vs float Keras)", SAVED_MODEL, ("float",),
     lambda model, path, images: tflite(model, path, images, dynamic_range_int8=True)),
    ("SavedModel -> TFLite", SAVED_MODEL, ("int8",), lambda model, path, images: (
        saved_model(model, path, images), tflite(model, path, images))[1]),
    ("ONNX (model.export)", ALL, ("float",), onnx),
    ("ONNX (torch.onnx.export, dynamo=True)", ("torch",), ("float",), torch_onnx),
    ("jax.export", ("jax",), ("float",), jax_export),
]

#: `{route: [difference or (variant, failure text), ...]}` of every variant measured.
RESULTS = {}


def measure(name, variant, function, reference):
    try:
        difference = float(np.abs(function() - reference).max())
        text = f"{difference:.1e}"
        RESULTS.setdefault(name, []).append(difference)
    except Exception as error:  # a route that fails is a row of the table too
        message = str(error).strip()
        op_error = re.search(r"'[\w.]+' op .*", message)  # the converter's MLIR error
        text = "fails: " + (op_error.group(0).split(" <unknown>")[0] if op_error
                            else (message.splitlines() or [type(error).__name__])[0])[:120]
        RESULTS.setdefault(name, []).append((variant, text))
    print(f"| {name} | {variant} | {keras.backend.backend()} | {text} |", flush=True)


def main():
    warnings.filterwarnings("ignore")
    backend = keras.backend.backend()
    work = tempfile.mkdtemp()
    print("| route | variant | backend | max abs difference |\n|---|---|---|---|")
    for variant in routes.VARIANTS:
        model, images = routes.tiny_model(variant)
        for kind in ("float", "int8"):
            if kind == "int8":
                model.quantize("int8")  # then every row compares with the int8 model's outputs
            expected = routes.keras_outputs(model, images)
            if kind == "float":
                RESULTS.setdefault("largest absolute Keras output (float)", []).append(
                    float(np.abs(expected).max()))
            path = os.path.join(work, f"{variant}_{kind}")
            for name, backends, kinds, outputs in ROUTES:
                if backend in backends and kind in kinds:
                    label = name if kind == "float" else f"int8 {name} (vs int8 Keras)"
                    measure(label, variant, lambda: outputs(model, path, images), expected)
    print(f"\n| route | {backend}: largest over {', '.join(routes.VARIANTS)} |\n|---|---|")
    for name, results in RESULTS.items():
        numbers = [r for r in results if isinstance(r, float)]
        text = f"{max(numbers):.1e}" if numbers else ""
        failures = {}
        for variant, failure in (r for r in results if isinstance(r, tuple)):
            failures.setdefault(failure, []).append(variant)
        for failure, variants in failures.items():
            text += ("; " if text else "") + f"{', '.join(variants)}: {failure}"
        print(f"| {name} | {text} |")


if __name__ == "__main__":
    main()
