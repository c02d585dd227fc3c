"""Train a ViT: the same command as `keras-vitnorm train` (run with --help for options).

    KERAS_BACKEND=jax python recipes/train.py                 # small pre-LN ViT on digits
    KERAS_BACKEND=jax python recipes/train.py --dataset tfds:cifar10 --epochs 100
"""

import sys

from keras_vitnorm.cli import console

if __name__ == "__main__":
    console(["train", *sys.argv[1:]])
