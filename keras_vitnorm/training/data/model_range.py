"""The range images enter the model in: float32 in [-1, 1] (big_vision's `value_range`)."""


def to_model_range(images):
    """float32 `images` in [0, 255], NumPy or tf.data, as `images / 127.5 - 1` in [-1, 1];
    cast uint8 NumPy images to float32 first (NumPy would compute in float64)."""
    return images / 127.5 - 1.0
