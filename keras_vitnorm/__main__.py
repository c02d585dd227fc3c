"""`python -m keras_vitnorm train ...` runs the `keras-vitnorm` command."""

from keras_vitnorm.cli import console

console()
