"""`Model.export` for the library's functional models, their input signature filled in."""

import keras


class SignedExports:
    """Mixin before `keras.Model`: `export` fills in the ONNX input signature from the model's
    single input, batch size open, which Keras needs for a model never called (docs/deploy.md).
    """

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        if input_signature is None and format == "onnx" and len(self.inputs) == 1:
            images = self.inputs[0]
            input_signature = [keras.InputSpec(shape=(None, *images.shape[1:]),
                                               dtype=images.dtype, name=images.name)]
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)
