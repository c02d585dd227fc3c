"""What Dual PatchNorm's first norm removes from the patches it sees.

`LN_0` takes each patch's mean (brightness) and standard deviation (contrast), which
its shared scale and shift cannot put back. These functions measure how much of an
image and of its class those two numbers per patch carry, and how much a trained
model's predictions rest on them (`patch_statistics_reliance`).
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


#: A variance floor for `standardize_patches`: patches whose standard deviation is
#: below about 0.1 (pixels in [-1, 1]) are scaled up less than to unit variance, so
#: near-flat patches do not turn into their noise stretched to full contrast.
VARIANCE_FLOOR = 1e-2


def low_contrast_share(patches, std=0.1):
    """Share of patch vectors whose standard deviation is below `std`: the patches that
    `LN_0` scales up the most (10x and more at 0.1, for pixels in [-1, 1])."""
    return float(np.mean(patches.std(axis=-1) < std))


def removed_statistics(patches):
    """`(mean, std)` of each patch vector, each `(batch, patches)`: what `LN_0` removes."""
    return patches.mean(axis=-1), patches.std(axis=-1)


def energy_in_patch_means(patches):
    """Share of the patch vectors' energy (sum of squares) in their means: `D * mean**2`."""
    dim = patches.shape[-1]
    return float(np.sum(dim * patches.mean(axis=-1) ** 2) / np.sum(patches**2))


#: Iteration limit of the linear probes' L-BFGS solver (scikit-learn's 100 is too few
#: for 3,072 features); a probe that reaches it is an error.
PROBE_MAX_ITER = 5000


def linear_probe_accuracy(train_features, train_labels, test_features, test_labels, seed=0):
    """Test accuracy of a multinomial logistic regression on standardized features,
    trained to convergence (`RuntimeError` if L-BFGS reaches `PROBE_MAX_ITER` first:
    an unconverged probe's accuracy depends on where it stopped)."""
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
            raise RuntimeError(
                f"The linear probe did not converge in {PROBE_MAX_ITER} iterations "
                f"({len(train_features)} examples of {train_features.shape[1]} features); "
                "its accuracy would depend on where it stopped. Raise "
                "keras_vitnorm.analysis.patch_norm.PROBE_MAX_ITER."
            ) from None
    return float(classifier.score(test_features.reshape(len(test_features), -1), test_labels))


def patch_norm_probe(train_images, train_labels, test_images, test_labels, patch_size):
    """Linear-probe accuracies on three views of the same images, and the energy share.

    Returns a dict:
        `pixels`: the images as they are (what the plain stem's embedding sees);
        `standardized_patches`: every patch after `LN_0` (what DPN's embedding sees);
        `patch_mean_and_std`: only the two numbers per patch that `LN_0` removes;
        `floored_patches`: every patch standardized with `VARIANCE_FLOOR` as epsilon
            (near-flat patches not stretched to full contrast);
        `energy_in_means`: `energy_in_patch_means` of the training images;
        `low_contrast`: `low_contrast_share` of the training images' patches;
        `removed_dims`, `patch_dim`: 2 of `P*P*C` dimensions per patch.
    """
    train = patch_vectors(train_images, patch_size)
    test = patch_vectors(test_images, patch_size)
    return {
        "pixels": linear_probe_accuracy(train, train_labels, test, test_labels),
        "standardized_patches": linear_probe_accuracy(
            standardize_patches(train), train_labels, standardize_patches(test), test_labels),
        "patch_mean_and_std": linear_probe_accuracy(
            np.stack(removed_statistics(train), -1), train_labels,
            np.stack(removed_statistics(test), -1), test_labels),
        "floored_patches": linear_probe_accuracy(
            standardize_patches(train, VARIANCE_FLOOR), train_labels,
            standardize_patches(test, VARIANCE_FLOOR), test_labels),
        "energy_in_means": energy_in_patch_means(train),
        "low_contrast": low_contrast_share(train),
        "removed_dims": 2,
        "patch_dim": train.shape[-1],
    }


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
    """Images whose patches have the pattern of `patterns_from` and the mean and standard
    deviation of `statistics_from`'s: `(x - mean(x)) / sqrt(var(x) + epsilon) * std(s) +
    mean(s)`, not clipped, so `LN_0` still sees `x`'s pattern exactly."""
    patterns_from = np.asarray(patterns_from, "float64")
    statistics_from = np.asarray(statistics_from, "float64")
    if patterns_from.ndim != 4 or patterns_from.shape != statistics_from.shape:
        raise ValueError(
            "combine_patches needs two batches of images of one shape (batch, height, width, "
            f"channels), got {patterns_from.shape} and {statistics_from.shape}.")
    height, width = patterns_from.shape[1:3]
    if patch_size < 1 or height % patch_size or width % patch_size:
        raise ValueError(f"Images of {height}x{width} are not whole patches of {patch_size}.")
    patches = patch_vectors(patterns_from, patch_size)
    mean, std = removed_statistics(patches)
    pattern = (patches - mean[..., None]) / np.sqrt(std[..., None] ** 2 + epsilon)
    donor_mean, donor_std = removed_statistics(patch_vectors(statistics_from, patch_size))
    combined = pattern * donor_std[..., None] + donor_mean[..., None]
    return images_from_patches(combined, patterns_from.shape, patch_size)


#: The keys of each split's `patch_statistics_reliance` result.
RELIANCE_KEYS = ("clean", "statistics_swapped", "statistics_swapped_to_donor",
                 "patterns_swapped", "patterns_swapped_to_donor", "images")


def patch_statistics_reliance(model, images, labels, seed=0, batch_size=250):
    """What a trained model's predictions rest on: each patch's mean and standard
    deviation, or its pattern.

    Every image is classified as it is, with a donor of another class's patch
    statistics, and with the donor's patterns; what survives each swap tells which part
    the model reads.

    Returns a dict: `clean`, `statistics_swapped` and `patterns_swapped` (accuracy
    against the images' own labels), `statistics_swapped_to_donor` and
    `patterns_swapped_to_donor` (share classified as the donor's class) and `images`.
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

    result = {"clean": float(np.mean(predictions(lambda i: images[i]) == labels)), "images": int(len(labels))}
    for name, combine in (
        ("statistics_swapped", lambda i: combine_patches(images[i], images[donors[i]], patch_size)),
        ("patterns_swapped", lambda i: combine_patches(images[donors[i]], images[i], patch_size)),
    ):
        predicted = predictions(combine)
        result[name] = float(np.mean(predicted == labels))
        result[name + "_to_donor"] = float(np.mean(predicted == labels[donors]))
    return result
