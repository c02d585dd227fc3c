"""Gradients of a loss with respect to a model's inputs and weights, on every backend:
`keras_vitnorm.backend.value_and_gradients`, which the probes of this package use."""

from keras_vitnorm.backend import value_and_gradients

__all__ = ["value_and_gradients"]
