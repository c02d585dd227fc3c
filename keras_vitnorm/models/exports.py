"""`Model.export` for the library's functional models, their input signature filled in."""

import keras


class SignedExports:
    """`export` as Keras' `Model.export`, the ONNX format's input signature filled in.

    Without an `input_signature`, Keras' ONNX export refuses a model that has not been
    called as `model(x)` (under JAX, `predict` does not count). A functional model knows
    its inputs, so the signature is taken from them, the batch size left open:
    `(None, height, width, channels)` named `images`, the signature Keras takes for the
    other formats. A signature passed is used as it is.

    A mixin, placed before `keras.Model` in the bases of a single-input model built from
    its inputs and outputs. Routes and their limits: docs/deploy.md.
    """

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        if input_signature is None and format == "onnx" and len(self.inputs) == 1:
            images = self.inputs[0]
            input_signature = [keras.InputSpec(shape=(None, *images.shape[1:]),
                                               dtype=images.dtype, name=images.name)]
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)
