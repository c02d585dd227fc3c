"""`Model.export` for the library's functional models, their input signature filled in."""

import keras


class SignedExports:
    """`export` as Keras' `Model.export`, the ONNX format's input signature filled in.

    Without one, Keras' ONNX export refuses a model not yet called as `model(x)`; the
    signature comes from the model's input, batch size open. A mixin before
    `keras.Model`, for single-input functional models (docs/deploy.md).
    """

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        if input_signature is None and format == "onnx" and len(self.inputs) == 1:
            images = self.inputs[0]
            input_signature = [keras.InputSpec(shape=(None, *images.shape[1:]),
                                               dtype=images.dtype, name=images.name)]
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)
