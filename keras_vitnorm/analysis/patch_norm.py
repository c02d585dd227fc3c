"""What Dual PatchNorm's first norm, `LN_0`, removes: each patch's mean and standard deviation.

How much of an image and of its class those two numbers carry, and how much a trained model
rests on them; docs/normalization-guide.md has the measurements.
"""

import numpy as np


def patch_vectors(images, patch_size):
    """`(batch, patches, P*P*C)` patch vectors in the model's `(row, column, channel)` order."""
    images = np.asarray(images, "float64")
    batch, height, width, channels = images.shape
    rows, columns = height // patch_size, width // patch_size
    x = images[:, : rows * patch_size, : columns * patch_size]
    x = x.reshape(batch, rows, patch_size, columns, patch_size, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows * columns, -1)


def standardize_patches(patches, epsilon=1e-6):
    """`LN_0` without its learned scale and shift: each patch vector to mean 0, variance 1."""
    mean = patches.mean(axis=-1, keepdims=True)
    variance = patches.var(axis=-1, keepdims=True)
    return (patches - mean) / np.sqrt(variance + epsilon)


#: A variance floor for `standardize_patches`: near-flat patches (std below about 0.1, pixels
#: in [-1, 1]) are not stretched to full contrast.
VARIANCE_FLOOR = 1e-2


def low_contrast_share(patches, std=0.1):
    """Share of patch vectors whose std is below `std`: those that `LN_0` scales up the most."""
    return float(np.mean(patches.std(axis=-1) < std))


def removed_statistics(patches):
    """`(mean, std)` of each patch vector, each `(batch, patches)`: what `LN_0` removes."""
    return patches.mean(axis=-1), patches.std(axis=-1)


def energy_in_patch_means(patches):
    """Share of the patch vectors' energy (sum of squares) in their means: `D * mean**2`."""
    dim = patches.shape[-1]
    return float(np.sum(dim * patches.mean(axis=-1) ** 2) / np.sum(patches**2))


#: Iteration limit of the linear probes' L-BFGS solver (scikit-learn's 100 is too few).
PROBE_MAX_ITER = 5000


def linear_probe_accuracy(train_features, train_labels, test_features, test_labels, seed=0):
    """Test accuracy of a logistic regression on standardized features, trained to convergence
    (`RuntimeError` if L-BFGS reaches `PROBE_MAX_ITER` first)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    classifier = make_pipeline(
        StandardScaler(), LogisticRegression(max_iter=PROBE_MAX_ITER, C=0.1, random_state=seed))
    train_features = train_features.reshape(len(train_features), -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        try:
            classifier.fit(train_features, train_labels)
        except ConvergenceWarning:
            raise RuntimeError(f"The linear probe did not converge in {PROBE_MAX_ITER} iterations "
                               f"({len(train_features)} examples of {train_features.shape[1]} "
                               "features); its accuracy would depend on where it stopped. Raise "
                               "keras_vitnorm.analysis.patch_norm.PROBE_MAX_ITER.") from None
    return float(classifier.score(test_features.reshape(len(test_features), -1), test_labels))


def patch_norm_probe(train_images, train_labels, test_images, test_labels, patch_size):
    """Linear-probe accuracies on views of the same images, and their patch statistics.

    Returns a dict: the accuracies on `pixels`, `standardized_patches` (after `LN_0`),
    `patch_mean_and_std` (only what `LN_0` removes) and `floored_patches` (`VARIANCE_FLOOR`);
    `energy_in_means` and `low_contrast` of the training patches; `removed_dims` of `patch_dim`.
    """
    train = patch_vectors(train_images, patch_size)
    test = patch_vectors(test_images, patch_size)
    views = {"pixels": lambda patches: patches,
             "standardized_patches": standardize_patches,
             "patch_mean_and_std": lambda patches: np.stack(removed_statistics(patches), -1),
             "floored_patches": lambda patches: standardize_patches(patches, VARIANCE_FLOOR)}
    accuracies = {name: linear_probe_accuracy(view(train), train_labels, view(test), test_labels)
                  for name, view in views.items()}
    return {**accuracies, "energy_in_means": energy_in_patch_means(train),
            "low_contrast": low_contrast_share(train), "removed_dims": 2,
            "patch_dim": train.shape[-1]}


def images_from_patches(patches, image_shape, patch_size):
    """The inverse of `patch_vectors` for images whose sides are whole patches."""
    batch, height, width, channels = image_shape
    rows, columns = height // patch_size, width // patch_size
    x = np.asarray(patches).reshape(batch, rows, columns, patch_size, patch_size, channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(image_shape)


def other_class_donors(labels, seed=0):
    """For each example, the index of a random example of another class."""
    labels = np.asarray(labels)
    if len(np.unique(labels)) < 2:
        raise ValueError("other_class_donors needs examples of at least two classes.")
    rng = np.random.default_rng(seed)
    donors = np.empty(len(labels), dtype=int)
    for i, label in enumerate(labels):
        candidates = np.flatnonzero(labels != label)
        donors[i] = candidates[rng.integers(len(candidates))]
    return donors


def combine_patches(patterns_from, statistics_from, patch_size, epsilon=1e-6):
    """Images with the patch patterns of `patterns_from` and the patch means and standard
    deviations of `statistics_from`: `standardize_patches(x) * std(s) + mean(s)`, not clipped."""
    patterns_from = np.asarray(patterns_from, "float64")
    statistics_from = np.asarray(statistics_from, "float64")
    if patterns_from.ndim != 4 or patterns_from.shape != statistics_from.shape:
        raise ValueError(
            "combine_patches needs two batches of images of one shape (batch, height, width, "
            f"channels), got {patterns_from.shape} and {statistics_from.shape}.")
    height, width = patterns_from.shape[1:3]
    if patch_size < 1 or height % patch_size or width % patch_size:
        raise ValueError(f"Images of {height}x{width} are not whole patches of {patch_size}.")
    pattern = standardize_patches(patch_vectors(patterns_from, patch_size), epsilon)
    donor_mean, donor_std = removed_statistics(patch_vectors(statistics_from, patch_size))
    combined = pattern * donor_std[..., None] + donor_mean[..., None]
    return images_from_patches(combined, patterns_from.shape, patch_size)


#: The keys of each split's `patch_statistics_reliance` result.
RELIANCE_KEYS = ("clean", "statistics_swapped", "statistics_swapped_to_donor",
                 "patterns_swapped", "patterns_swapped_to_donor", "images")


def patch_statistics_reliance(model, images, labels, seed=0, batch_size=250):
    """What a trained model's predictions rest on: each patch's statistics, or its pattern.

    Each image is classified as it is, with the patch statistics and with the patterns of a
    donor of another class (docs/normalization-guide.md). Returns a dict of `RELIANCE_KEYS`:
    accuracies, `*_to_donor` the share classified as the donor's class, `images` the count.
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 4 or len(labels) != len(images):
        raise ValueError(
            f"patch_statistics_reliance needs (batch, height, width, channels) images and one "
            f"label per image, got images of shape {images.shape} and {len(labels)} labels.")
    patch_size = model.get_config()["patch_size"]
    donors = other_class_donors(labels, seed)

    def predictions(images_of):
        # Batch by batch, so that the float64 patches of large images never all exist at once.
        predicted = []
        for start in range(0, len(labels), batch_size):
            index = np.arange(start, min(start + batch_size, len(labels)))
            x = np.asarray(images_of(index), "float32")
            predicted.append(np.argmax(model.predict(x, batch_size=batch_size, verbose=0), axis=-1))
        return np.concatenate(predicted)

    result = {"clean": float(np.mean(predictions(lambda i: images[i]) == labels)),
              "images": int(len(labels))}
    for name, combine in (
        ("statistics_swapped", lambda i: combine_patches(images[i], images[donors[i]], patch_size)),
        ("patterns_swapped", lambda i: combine_patches(images[donors[i]], images[i], patch_size)),
    ):
        predicted = predictions(combine)
        result[name] = float(np.mean(predicted == labels))
        result[name + "_to_donor"] = float(np.mean(predicted == labels[donors]))
    return result
