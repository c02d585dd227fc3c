"""Run the normalization study: the same command as `keras-vitnorm ablate` (--help for options).

    KERAS_BACKEND=torch python recipes/ablate.py --groups placements stems --seeds 0 1 2 \
        --epochs 15 --output-dir runs/study-digits

The measured results of that command and of the CIFAR-10 study are in
docs/normalization-guide.md, with the exact commands.
"""

import sys

from keras_vitnorm.cli import console

if __name__ == "__main__":
    console(["ablate", *sys.argv[1:]])
