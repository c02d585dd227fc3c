"""Prints how far each deployment route's outputs are from Keras' (docs/deploy.md).

    for b in jax tensorflow torch; do KERAS_BACKEND=$b python tools/deploy_parity.py; done

For each variant of `deploy_routes.VARIANTS` (the `TINY` ViT: 32x32 images in 8-px
patches, width 32, depth 2, 2 heads, MLP 64, 5 classes, every weight perturbed), exports
the model by each route the backend offers, runs the artifact on the same two images
with the route's own runtime and prints the largest absolute difference from the Keras
model's outputs (for the int8 rows, from the int8 Keras model's, or from the float
model's for TFLite's own quantization). A route that fails prints its error's first line.
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

VARIANTS = ("dpn", "plain", "rmsnorm_post", "dyt_deepnorm", "sub_ln", "normformer")


#: `{route: [difference or failure text, ...]}` of every variant measured.
RESULTS = {}


def measure(name, variant, function, reference):
    try:
        got = function()
        text = f"{np.abs(got - reference).max():.1e}"
        RESULTS.setdefault(name, []).append(float(np.abs(got - reference).max()))
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
    for variant in VARIANTS:
        model, images = routes.tiny_model(variant)
        expected = routes.keras_outputs(model, images)
        RESULTS.setdefault("largest absolute Keras output (float)", []).append(
            float(np.abs(expected).max()))
        path = os.path.join(work, variant)
        keras_file = path + ".keras"
        model.save(keras_file)
        measure(".keras", variant, lambda: routes.keras_outputs(
            keras.saving.load_model(keras_file), images), expected)
        from keras_vitnorm import ViT

        model.save_to_preset(path + "_preset")
        measure("preset", variant, lambda: routes.keras_outputs(
            ViT.from_preset(path + "_preset"), images), expected)
        if backend in ("jax", "tensorflow"):
            saved = path + "_saved"
            model.export(saved, verbose=False)
            measure("SavedModel", variant, lambda: routes.serve_saved_model(saved, images),
                    expected)
            measure("TFLite float", variant, lambda: routes.run_tflite(
                routes.tflite_from_saved_model(saved), images), expected)
            measure("TFLite dynamic-range int8 (vs float Keras)", variant,
                    lambda: routes.run_tflite(routes.tflite_from_saved_model(
                        saved, dynamic_range_int8=True), images), expected)
        onnx_file = path + ".onnx"
        measure("ONNX (model.export)", variant, lambda: (
            model.export(onnx_file, format="onnx", verbose=False),
            routes.run_onnx(onnx_file, images))[1], expected)
        if backend == "torch":
            dynamo_file = path + "_dynamo.onnx"
            measure("ONNX (torch.onnx.export, dynamo=True)", variant, lambda: (
                routes.torch_onnx_any_batch(model, images, dynamo_file),
                routes.run_onnx(dynamo_file, images))[1], expected)
        if backend == "jax":
            measure("jax.export", variant, lambda: routes.run_jax_export(
                routes.jax_export(model, images.shape[1:]), images), expected)
        # Keras' int8 quantization, then the routes of the quantized model.
        model.quantize("int8")
        quantized = routes.keras_outputs(model, images)
        model.save(keras_file)
        measure("int8 .keras (vs int8 Keras)", variant, lambda: routes.keras_outputs(
            keras.saving.load_model(keras_file), images), quantized)
        model.save_to_preset(path + "_int8_preset")
        measure("int8 preset (vs int8 Keras)", variant, lambda: routes.keras_outputs(
            ViT.from_preset(path + "_int8_preset"), images), quantized)
        if backend in ("jax", "tensorflow"):
            saved = path + "_int8_saved"
            measure("int8 SavedModel -> TFLite (vs int8 Keras)", variant, lambda: (
                model.export(saved, verbose=False),
                routes.run_tflite(routes.tflite_from_saved_model(saved), images))[1], quantized)
    print(f"\n| route | {backend}: largest over {', '.join(VARIANTS)} |\n|---|---|")
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
