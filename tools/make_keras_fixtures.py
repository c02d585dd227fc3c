"""Generates the cross-backend `.keras` fixtures in tests/fixtures/keras_files/.

Under each Keras backend, each model below is built tiny, compiled with AdamW, trained
one step (so that the optimizer's state is in the file too) and saved with
`model.save` to `<backend>/<name>.keras`, beside `<backend>/<name>.npz`: the inputs,
the model's outputs on them in inference, one training batch and the optimizer's step
count. tests/test_keras_files.py loads every other backend's files in safe mode,
requires the same outputs, and continues `fit` from the saved optimizer state.

Run (writes the files of all three backends, each in a process of its own):

    python tools/make_keras_fixtures.py

or one backend's only:

    KERAS_BACKEND=torch python tools/make_keras_fixtures.py --this-backend

Regenerate when a saved model's structure (its layers, their names or config) changes
on purpose: the fixtures are what a user's saved files look like to the next version.
"""

import os
import subprocess
import sys

OUTPUT_DIR = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "keras_files")
BACKENDS = ("jax", "tensorflow", "torch")
TINY = {"image_size": 8, "patch_size": 4, "width": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16,
        "num_classes": 3}
CAPTIONS = ["a red square", "a blue circle", "two green lines", "one red line"]
#: The models saved, by file name.
MODELS = ("vit", "lit")


def build(name):
    """`(model, inputs, targets or None)` of the fixture `name`, compiled."""
    import keras
    import numpy as np

    from keras_vitnorm import LiT
    from keras_vitnorm import ViT
    from keras_vitnorm.models.contrastive import caption_vocabulary

    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    # The conv stem and BatchNorm put non-trainable state (moving statistics) in the file.
    vit = ViT(**TINY, stem="conv", norm="batchnorm", block_style="normformer", qk_norm=False,
              layer_scale=0.1, name="vit")
    optimizer = keras.optimizers.AdamW(1e-2)
    if name == "vit":
        vit.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return vit, images, np.array([0, 1, 2, 0])
    model = LiT(ViT(**TINY, stem="post_posemb", norm="dyt"), caption_vocabulary(CAPTIONS),
                max_length=4, embed_dim=8, text_width=8, text_depth=1, text_heads=2,
                text_mlp_dim=16, loss="sigmoid", freeze_image_tower=False)
    model.compile(optimizer)
    return model, {"images": images, "tokens": model.tokenize(CAPTIONS)}, None


def _arrays(structure):
    import keras

    return {key: keras.ops.convert_to_numpy(value) for key, value in
            (structure.items() if isinstance(structure, dict) else [("", structure)])}


def write_this_backend():
    import keras
    import numpy as np

    backend = keras.backend.backend()
    directory = os.path.join(OUTPUT_DIR, backend)
    os.makedirs(directory, exist_ok=True)
    for name in MODELS:
        keras.utils.set_random_seed(0)
        model, inputs, targets = build(name)
        model.fit(inputs, targets, batch_size=4, epochs=1, verbose=0)
        outputs = model(inputs, training=False)
        arrays = {f"input:{k}": v for k, v in _arrays(inputs).items()}
        arrays.update({f"output:{k}": v for k, v in _arrays(outputs).items()})
        if targets is not None:
            arrays["targets"] = targets
        arrays["iterations"] = np.asarray(int(model.optimizer.iterations))
        model.save(os.path.join(directory, f"{name}.keras"))
        np.savez(os.path.join(directory, f"{name}.npz"), **arrays)
        print(f"{backend}/{name}: {model.count_params()} parameters")


def main():
    if "--this-backend" in sys.argv[1:]:
        write_this_backend()
        return
    for backend in BACKENDS:
        environment = {**os.environ, "KERAS_BACKEND": backend}
        subprocess.run([sys.executable, __file__, "--this-backend"], env=environment, check=True)


if __name__ == "__main__":
    main()
