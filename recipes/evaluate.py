"""Score a saved run or preset: the same command as `keras-vitnorm evaluate`.

    KERAS_BACKEND=jax python recipes/evaluate.py runs/<run> [--dataset digits]
"""

import sys

from keras_vitnorm.cli import console

if __name__ == "__main__":
    console(["evaluate", *sys.argv[1:]])
