"""The few-shot linear classifier of big_vision's `big_vision/evaluators/fewshot_lsr.py`:
ridge regression of ±1 targets on whitened features, in closed form, and its draws of
the training images (`keras_vitnorm.study.fewshot` applies them to a study's models)."""

import numpy as np

#: The ridge penalty: big_vision's `l2_reg` (`configs/common_fewshot.py`), one fixed value.
L2_REGULARIZATION = 2.0**10
#: The constant feature that carries the bias: large, so its weight is barely penalized.
BIAS_FEATURE = 100.0
#: Added to each feature's standard deviation before whitening.
WHITENING_EPSILON = 1e-5


class LeastSquaresClassifier:
    """A linear classifier fitted by `fit_least_squares`: whitening and ridge weights."""

    def __init__(self, mean, std, weights):
        self.mean, self.std, self.weights = mean, std, weights

    def predict(self, features):
        """The class of each row of `features`: the largest of its regression outputs."""
        return np.argmax(_design(features, self.mean, self.std) @ self.weights, axis=1)

    def accuracy(self, features, labels):
        return float(np.mean(self.predict(features) == np.asarray(labels)))


def _design(features, mean, std):
    whitened = (np.asarray(features, "float64") - mean) / std
    return np.pad(whitened, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)


def fit_least_squares(features, labels, num_classes, l2_regularization=L2_REGULARIZATION):
    """A `LeastSquaresClassifier` of `features` `(images, width)` and `labels` `(images,)`
    in `[0, num_classes)`: big_vision's closed-form ridge regression onto ±1 targets on
    whitened features, in float64 (docs/study.md, "Few-shot linear transfer")."""
    from scipy import linalg

    features, labels = np.asarray(features, "float64"), np.asarray(labels)
    if features.ndim != 2 or labels.shape != features.shape[:1] or not len(labels):
        raise ValueError(f"features must be (images, width) with one label per image, got "
                         f"features {features.shape} and labels {labels.shape}.")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got {labels.min()} to "
                         f"{labels.max()}.")
    if not l2_regularization > 0:
        raise ValueError(f"l2_regularization must be positive, got {l2_regularization!r}.")
    mean = features.mean(axis=0, keepdims=True)
    std = features.std(axis=0, keepdims=True) + WHITENING_EPSILON
    design = _design(features, mean, std)
    targets = 2.0 * np.eye(num_classes)[labels] - 1.0
    if len(design) >= design.shape[1]:
        eigenvalues, vectors = linalg.eigh(design.T @ design)
        left, right = vectors, vectors.T @ (design.T @ targets)
    else:
        eigenvalues, vectors = linalg.eigh(design @ design.T)
        left, right = design.T @ vectors, vectors.T @ targets
    weights = (left / (eigenvalues + l2_regularization)) @ right
    return LeastSquaresClassifier(mean, std, weights)


def few_shot_draws(labels, num_classes, shots, draws, class_names=None):
    """`(draws, num_classes, shots)` indices into `labels`: draw `d` takes each class's first
    `shots` images permuted with seed `d`; a `ValueError` names classes with too few."""
    labels = np.asarray(labels)
    members = [np.flatnonzero(labels == label) for label in range(num_classes)]
    short = [(class_names[label] if class_names else str(label), len(indices))
             for label, indices in enumerate(members) if len(indices) < shots]
    if short:
        named = ", ".join(f"{name!r} ({count})" for name, count in short)
        raise ValueError(f"{shots} shots need {shots} training images of every class; "
                         f"class(es) {named} have fewer. Use fewer shots.")
    return np.stack([
        np.stack([rng.permutation(indices)[:shots] for indices in members])
        for rng in (np.random.default_rng(draw) for draw in range(draws))])
