"""The range images enter the model in: float32 in [-1, 1] (big_vision's
`value_range(-1, 1)`), from decoded images in [0, 255]."""


def to_model_range(images):
    """float32 `images` in [0, 255] as the model takes them: `images / 127.5 - 1`, in [-1, 1].

    Plain arithmetic with Python numbers, so it computes in the images' own float32,
    NumPy array or tf.data tensor (NumPy takes uint8 to float64: cast to float32 first).
    """
    return images / 127.5 - 1.0
