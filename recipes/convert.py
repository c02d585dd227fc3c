"""Convert a standard ViT checkpoint to a keras_vitnorm preset: the same command as
`keras-vitnorm convert` (--help for options; docs/checkpoints.md).

    python recipes/convert.py checkpoints/vit-base-patch16-224 presets/b16_hf
"""

import sys

from keras_vitnorm.cli import console

if __name__ == "__main__":
    console(["convert", *sys.argv[1:]])
