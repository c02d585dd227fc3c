"""LiT training through `model.fit`: `keras-vitnorm lit` and its API (docs/contrastive.md,
"The offline data": the templates that caption the classes)."""
import dataclasses
import time

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.models.contrastive import LiT
from keras_vitnorm.models.contrastive import caption_vocabulary
from keras_vitnorm.models.contrastive import check_class_names_fit
from keras_vitnorm.models.vit import ViT
from keras_vitnorm.models.vit_config import in_model_range
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training import run_files
from keras_vitnorm.training.optimizer import adamw
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int

MODEL_FILE = "lit.keras"
TRAIN_TEMPLATES = (
    "a photo of a {}.",
    "a picture of the {}.",
    "an image showing a {}.",
    "a small photo of a {}.",
    "the {} in a photo.",
)
HELD_OUT_TEMPLATES = (
    "a low resolution photo of the {}.",
    "a cropped photo of a {}.",
    "this is a {}.",
)
#: Class names of scikit-learn's digits as words, for its captions.
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclasses.dataclass
class LiTConfig:
    """What `train_lit` trains; `keras_vitnorm.models.contrastive.LiT` has the model's arguments.

    `preset` is the image tower; `image_size` resizes the images and resamples its
    position embedding.
    """

    dataset: str = "digits"
    preset: str = "ti16"
    image_size: int = 32
    model: dict = dataclasses.field(default_factory=dict)
    freeze_image_tower: bool = True
    loss: str = "softmax"
    embed_dim: int = 128
    max_length: int = 16
    text_width: int = 128
    text_depth: int = 2
    text_heads: int = 4
    text_mlp_dim: int = 512
    train_examples: int = None
    epochs: int = 10
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.05
    seed: int = 0

    def __post_init__(self):
        for name in ("image_size", "epochs", "batch_size", "embed_dim", "max_length"):
            check_positive_int(name, getattr(self, name))
        check_positive_float("learning_rate", self.learning_rate)
        if self.batch_size < 2:
            raise ValueError("batch_size must be at least 2 for a contrastive loss, got "
                             f"{self.batch_size}.")
        # Any class name: checked again with the dataset's names once they are read.
        check_class_names_fit(self.max_length, None, TRAIN_TEMPLATES + HELD_OUT_TEMPLATES)


def class_names_for(data):
    """Words for a dataset's classes: digits' numerals as words, folder and tfds names as given."""
    if data.name == "digits":
        return list(DIGIT_NAMES)
    return [name.replace("_", " ") for name in data.class_names]


def captions_for(labels, class_names, templates, seed):
    """One caption per label: a template drawn with `seed`, filled with the class name."""
    choice = np.random.default_rng(seed).integers(0, len(templates), len(labels))
    return [templates[t].format(class_names[int(label)]) for t, label in zip(choice, labels)]


def build_lit(config, vocabulary):
    """The `LiT` model of `config`: the image tower from its preset, a fresh text tower."""
    overrides = in_model_range(  # `eval_arrays` feeds [-1, 1]
        {key: value for key, value in config.model.items() if key != "image_size"})
    vit = ViT.from_preset(config.preset, image_size=config.image_size, **overrides)
    return LiT(vit, vocabulary, max_length=config.max_length, embed_dim=config.embed_dim,
               freeze_image_tower=config.freeze_image_tower, loss=config.loss,
               text_width=config.text_width, text_depth=config.text_depth,
               text_heads=config.text_heads, text_mlp_dim=config.text_mlp_dim)


def zero_shot_accuracy(model, images, labels, class_names, templates):
    """Share of `images` whose zero-shot class under `templates` is their label."""
    classifier = model.zero_shot_classifier(class_names, list(templates))
    return float(np.mean(model.zero_shot_predict(images, classifier) == labels))


def train_lit(config, output_dir=None, overwrite=False, verbose=1, take_over_lock=False):
    """Trains the text tower (and the image tower if not frozen); returns the metrics dict.

    `output_dir`, `overwrite` and `take_over_lock` are as in `train_segmenter`.
    """
    with run_files.results_run(output_dir, "LiT run", overwrite, take_over_lock) as save:
        metrics, model = _train_lit(config, verbose)
        save(model, MODEL_FILE, metrics)
    return metrics


def _train_lit(config, verbose):
    data = data_lib.load_dataset(config.dataset, train_examples=config.train_examples)
    names = class_names_for(data)
    check_class_names_fit(config.max_length, names, TRAIN_TEMPLATES + HELD_OUT_TEMPLATES)
    keras.utils.set_random_seed(config.seed)
    # The vocabulary holds the training templates' words and the class names only: the
    # held-out templates' other words are unknown tokens to the text tower.
    vocabulary = caption_vocabulary([t.format(n) for t in TRAIN_TEMPLATES for n in names])
    model = build_lit(config, vocabulary)
    channels = model.vit_config["num_channels"]
    size = (config.image_size, config.image_size)
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = (
        data_lib.eval_arrays(data, split, size, channels, 256)
        for split in (data.train, data.validation, data.test))
    train_captions = captions_for(y_train, names, TRAIN_TEMPLATES, config.seed)
    steps = config.epochs * max(1, len(x_train) // config.batch_size)
    model.compile(optimizer=adamw(model, steps, config.learning_rate,
                                  warmup_steps=config.warmup_steps,
                                  weight_decay=config.weight_decay))
    # Shuffled once (seed 0): a fixed validation batch of one class holds no negatives.
    order = np.random.default_rng(0).permutation(len(x_val))
    x_val, y_val = x_val[order], y_val[order]
    val_captions = captions_for(y_val, names, TRAIN_TEMPLATES, config.seed + 1)
    started = time.time()
    history = model.fit(
        {"images": x_train, "tokens": model.tokenize(train_captions)},
        batch_size=config.batch_size, epochs=config.epochs, shuffle=True, verbose=verbose,
        validation_data=({"images": x_val, "tokens": model.tokenize(val_captions)},))
    metrics = {
        "status": "completed",
        "config": dataclasses.asdict(config),
        "dataset": data.describe(),
        "zero_shot_test_accuracy": zero_shot_accuracy(model, x_test, y_test, names,
                                                      HELD_OUT_TEMPLATES),
        "zero_shot_test_accuracy_train_templates": zero_shot_accuracy(model, x_test, y_test, names,
                                                                      TRAIN_TEMPLATES),
        "history": {key: [float(v) for v in values] for key, values in history.history.items()},
        "train_seconds": round(time.time() - started, 2),
        "backend": backend.name(),
    }
    return metrics, model
