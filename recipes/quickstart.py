"""Quickstart: build a Dual PatchNorm ViT preset and classify a batch.

    python recipes/quickstart.py                       # s16_dpn, 10 classes
    python recipes/quickstart.py --preset ti16 --norm rmsnorm

Builds the preset (fresh weights: no checkpoint is downloaded), prints where its
norms sit and how many parameters it has, runs a forward pass on a batch of random
images, and prints the predicted classes. Runs under any Keras backend
(`KERAS_BACKEND=jax|tensorflow|torch`).
"""

import argparse
import sys
import time

import keras
import numpy as np

import keras_vitnorm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="s16_dpn", help="preset name (see --list)")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--norm", default=None, help="override the block norm, e.g. rmsnorm")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, description in keras_vitnorm.list_presets().items():
            print(f"{name:10s} {description}")
        return 0
    overrides = {"num_classes": args.num_classes}
    if args.norm:
        overrides["norm"] = args.norm
    try:
        model = keras_vitnorm.ViT.from_preset(args.preset, **overrides)
    except ValueError as error:
        parser.error(str(error))
    config = model.get_config()
    print(f"backend: {keras.backend.backend()}")
    print(
        f"{args.preset}: {model.count_params():,} parameters; stem={config['stem']}, "
        f"norm={config['norm']}, attn_norm={config['attn_norm']}, mlp_norm={config['mlp_norm']}, "
        f"block_style={config['block_style']}"
    )
    size = config["image_size"]
    images = np.random.default_rng(0).uniform(size=(args.batch_size, size, size, 3))
    start = time.perf_counter()
    logits = keras.ops.convert_to_numpy(model.predict(images.astype("float32"), verbose=0))
    print(f"forward pass on {args.batch_size} images: {time.perf_counter() - start:.2f} s")
    print(f"logits shape {logits.shape}; predicted classes {logits.argmax(-1).tolist()}")
    print("(fresh weights: the head starts at zero, as in big_vision, so every logit is 0 until trained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
