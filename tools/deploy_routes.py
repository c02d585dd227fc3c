"""The deployment routes of docs/deploy.md, for tests/test_deploy.py and tools/deploy_parity.py.

Each function is the code docs/deploy.md shows: it exports a model by one route, or runs
an exported artifact with that route's own runtime (TensorFlow, the TFLite interpreter,
ONNX Runtime, JAX) and returns its outputs as NumPy.
"""

import keras
import numpy as np

#: The small model every route is measured on (tests and tools/deploy_parity.py).
TINY = {"image_size": 32, "patch_size": 8, "width": 32, "depth": 2, "num_heads": 2,
        "mlp_dim": 64, "num_classes": 5}
#: Variants whose layers differ: stem norms, norm type, placement, block style.
VARIANTS = {
    "dpn": {"stem": "dual_patchnorm"},
    "plain": {},
    "rmsnorm_post": {"norm": "rmsnorm", "attn_norm": "post", "mlp_norm": "post"},
    "dyt_deepnorm": {"norm": "dyt", "block_style": "deepnorm"},
    "sub_ln": {"block_style": "sub_ln"},
    "normformer": {"block_style": "normformer"},
}


def tiny_model(variant="dpn", seed=3, batch=2, **overrides):
    """`(ViT, images)`: a `TINY` model of `VARIANTS[variant]` with every weight moved by
    0.1 N(0, 1) (the head starts at zero, the norms at the identity), and `batch`
    images in [-1, 1]; all seeded (the initial weights differ between backends)."""
    from keras_vitnorm import ViT

    keras.utils.set_random_seed(seed)
    config = {**TINY, **VARIANTS[variant], **overrides}
    model = ViT(**config)
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        noise = 0.1 * rng.standard_normal(variable.shape)
        variable.assign(keras.ops.convert_to_numpy(variable) + noise.astype(variable.dtype))
    size = config["image_size"]
    return model, rng.uniform(-1, 1, (batch, size, size, 3)).astype("float32")


def keras_outputs(model, images):
    return keras.ops.convert_to_numpy(model(images, training=False))


def serve_saved_model(directory, images):
    """The outputs of a SavedModel written by `model.export(directory)` (format
    `"tf_saved_model"`), through `tf.saved_model.load`."""
    import tensorflow as tf

    served = tf.saved_model.load(directory)  # kept alive while its function runs
    return served.serve(tf.constant(images)).numpy()


def tflite_from_saved_model(directory, dynamic_range_int8=False):
    """The `.tflite` flatbuffer (bytes) of a SavedModel; `dynamic_range_int8` stores the
    weights in int8 (TFLite's dynamic-range quantization, `Optimize.DEFAULT`)."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(directory)
    if dynamic_range_int8:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    return converter.convert()


def run_tflite(flatbuffer, images):
    """The outputs of a `.tflite` flatbuffer on `images`, through TFLite's interpreter
    (resized to their batch size)."""
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=flatbuffer)
    source = interpreter.get_input_details()[0]
    interpreter.resize_tensor_input(source["index"], images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(source["index"], images)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def run_onnx(path, images):
    """The outputs of an ONNX file on `images`, through ONNX Runtime."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path)
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def torch_onnx_any_batch(model, images, path):
    """Writes `model` (PyTorch backend) to an ONNX file that takes any batch size, with
    PyTorch's `torch.export`-based exporter (`dynamo=True`).

    Keras' ONNX export of an open batch size uses PyTorch's TorchScript exporter,
    which has no ONNX form of `aten::rms_norm` (an RMSNorm model's op); this exporter
    has one, and it takes every norm of the library.
    """
    import torch

    model.eval()
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.onnx.export(
        model, (torch.from_numpy(images),), dynamo=True, input_names=["images"],
        dynamic_shapes=(({0: batch},),),  # Keras' `forward(*args)`: one tuple of inputs
        verbose=False)
    program.optimize()
    program.save(path)


def jax_export(model, image_shape):
    """`model`'s forward pass (JAX backend) serialized by `jax.export` (bytes), the
    weights as constants, the batch size symbolic; `image_shape` is
    `(height, width, channels)`."""
    import jax
    from jax import export

    def serve(images):
        return model(images, training=False)

    shape = export.symbolic_shape("batch, " + ", ".join(map(str, image_shape)))
    exported = export.export(jax.jit(serve))(jax.ShapeDtypeStruct(shape, "float32"))
    return exported.serialize()


def run_jax_export(serialized, images):
    """The outputs of a `jax.export` serialization on `images`."""
    from jax import export

    return np.asarray(export.deserialize(serialized).call(images))
