"""`TrainConfig`: every setting of a training run, with checks that name bad values."""

import contextlib
import dataclasses
import json
import math
import os

import keras

from keras_vitnorm import hub_handles
from keras_vitnorm.choices import CROP_MODES
from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.choices import OPTIMIZERS
from keras_vitnorm.choices import PRECISIONS
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.training.data import Augmentation
from keras_vitnorm.training.data import check_pipeline
from keras_vitnorm.training.data import parse_dataset
from keras_vitnorm.training.recipes import get_recipe


def names_trained_model(preset):
    """Whether `preset` names a trained model (a directory, a checkpoint, a hub handle)."""
    return isinstance(preset, str) and (os.path.exists(preset) or hub_handles.is_handle(preset))


@contextlib.contextmanager
def dtype_policy(name):
    """Keras' global dtype policy is `name` (a `mixed_precision` setting) in the block."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def setting_changes(saved, current):
    """`"key: saved X, now Y; ..."` for every setting that differs, or `""`. A setting
    missing from `saved` counts as `None`, the "off" default of every later setting."""
    changed = sorted(key for key in current if saved.get(key) != current[key])
    return "; ".join(f"{k}: saved {saved.get(k)!r}, now {current[k]!r}" for k in changed)


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run; start from `TrainConfig.from_recipe`. The flags of
    the same names: docs/training.md.

    Attributes:
        recipe: name of the recipe the defaults came from (recorded with the run).
        preset: built-in preset name, preset directory or ViT checkpoint to fine-tune.
        model: dict of ViT config overrides; `num_classes` always comes from the
            dataset, `num_channels` too unless given here.
        dataset: `"digits"`, `"tfds:<name>"` or `"folder:<path>"`.
        val_fraction: share of the training data held out when there is no validation split.
        train_examples: a class-stratified subset of this size, the same for every seed.
        val_examples: validate on this many training examples apart from the
            `train_examples` (VTAB-1k's 800 + 200); `None`: the validation split.
        skip_bad_images: folder datasets leave out (and list) files that are not images.
        data_dir, manual_dir: tensorflow-datasets data and manual-download folders.
        epochs, steps: training length; give one (`steps` is kept exactly).
        steps_per_epoch: steps between validations; default one pass over the split.
        batch_size: global batch size (split over devices with `distribute`).
        learning_rate, warmup_steps, min_learning_rate: linear warm-up from 0, cosine.
        weight_decay: AdamW decay in Keras' convention, on kernels only.
        optimizer: `"adamw"` (`None` too) or `"sgd"`; momentum: SGD's, `None` = 0.9.
        beta_1, beta_2: Adam moment decay rates.
        label_smoothing: float in [0, 1).
        grad_clip: global-norm clipping threshold; `None` or 0 = off.
        drop_path: stochastic depth rate of the last block (overrides the model's).
        crop, crop_padding, zoom, flip, randaugment_ops, randaugment_factor, mixup,
            cutmix: augmentation, see `keras_vitnorm.training.data.Augmentation`.
        mixed_precision: `"float32"`, `"mixed_bfloat16"` or `"mixed_float16"`.
        seed: seeds weights, data order and augmentation.
        output_dir: run directory; default `runs/<preset>-<dataset>-<time>`.
        backup_every: steps between mid-epoch backups (`None`: end of epoch only).
        shuffle_buffer: tf.data's shuffle buffer (examples).
        input_pipeline: `"auto"`, `"tf.data"` or `"python"` (see `load_dataset`).
        distribute: `False`, `"data"` (or `True`) or `"fsdp"` (JAX; `training.distribution`).
        tensorboard: bool, write TensorBoard logs.
        grad_norm_every: steps between per-layer gradient-norm records; `None` = off.
    """

    recipe: str = "small"
    preset: str = "ti16"
    model: dict = dataclasses.field(default_factory=dict)
    dataset: str = "digits"
    val_fraction: float = 0.1
    train_examples: int = None
    val_examples: int = None
    skip_bad_images: bool = None
    data_dir: str = None
    manual_dir: str = None
    epochs: int = None
    steps: int = None
    steps_per_epoch: int = None
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    min_learning_rate: float = 0.0
    weight_decay: float = 0.05
    optimizer: str = None
    momentum: float = None
    beta_1: float = 0.9
    beta_2: float = 0.999
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    drop_path: float = None
    crop: str = Augmentation.crop
    crop_padding: int = Augmentation.crop_padding
    zoom: float = Augmentation.zoom
    flip: bool = Augmentation.flip
    randaugment_ops: int = Augmentation.randaugment_ops
    randaugment_factor: float = Augmentation.randaugment_factor
    mixup: float = Augmentation.mixup
    cutmix: float = Augmentation.cutmix
    mixed_precision: str = "float32"
    seed: int = 0
    output_dir: str = None
    backup_every: int = None
    shuffle_buffer: int = 50_000
    input_pipeline: str = "auto"
    distribute: object = False
    tensorboard: bool = True
    grad_norm_every: int = None

    @classmethod
    def field_names(cls):
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_recipe(cls, recipe="small", **overrides):
        """The recipe's settings, then `overrides` (a `None` override is ignored).

        `model` overrides merge into the recipe's, or into its `checkpoint_model` for a
        saved preset or checkpoint; `epochs` clears the recipe's `steps` and vice versa.
        """
        values = {"recipe": recipe, **get_recipe(recipe)}
        checkpoint_model = values.pop("checkpoint_model", {})
        unknown = sorted(set(overrides) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"Unknown training setting(s) {unknown}. Valid: "
                             f"{', '.join(cls.field_names())}.")
        overrides = {key: value for key, value in overrides.items() if value is not None}
        if "epochs" in overrides:
            values.pop("steps", None)
        if "steps" in overrides:
            values.pop("epochs", None)
        if names_trained_model(overrides.get("preset", values.get("preset"))):
            values["model"] = checkpoint_model
        model = {**values.get("model", {}), **overrides.pop("model", {})}
        config = cls(**{**values, **overrides, "model": model})
        config.validate()
        config.given = frozenset(overrides)
        return config

    #: The settings given to `from_recipe` (`None`: all); a run fits the recipe's other
    #: settings to a dataset too small for them (`run_plan.fit_to_data`).
    given = None

    def validate(self):
        """Raises a `ValueError` naming the first bad setting."""
        parse_dataset(self.dataset)
        if self.preset is None:
            raise ValueError(f"The {self.recipe!r} recipe fine-tunes a trained model: pass "
                             "--preset with a preset directory or a checkpoint "
                             "(docs/checkpoints.md).")
        if not names_trained_model(self.preset):
            preset_config(self.preset)  # raises, naming close matches, unless it is built in
            if get_recipe(self.recipe)["preset"] is None:
                raise ValueError(
                    f"--preset {self.preset!r} is a built-in architecture without weights, and "
                    f"the {self.recipe!r} recipe fine-tunes a trained model: pass a preset "
                    "directory or a checkpoint (docs/checkpoints.md), or train the architecture "
                    "from scratch with the 'small' or 'augreg_i1k' recipe."
                )
        for name in ("data_dir", "manual_dir"):
            value = getattr(self, name)
            if value is not None and os.path.exists(value) and not os.path.isdir(value):
                raise ValueError(f"{name}={value!r} is a file: it names a folder (of "
                                 "tensorflow-datasets data, or of downloaded archives).")
        check_choice("mixed_precision", self.mixed_precision, PRECISIONS)
        check_choice("crop", self.crop, CROP_MODES)
        check_pipeline(self.input_pipeline, self.dataset)
        if self.distribute not in (None, False, True):
            check_choice("distribute", self.distribute, DISTRIBUTIONS)
        if self.optimizer is not None:
            check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.momentum is not None:
            self._check_range("momentum", 0.0, 1.0)
            if self.optimizer != "sgd":
                raise ValueError(f"momentum={self.momentum} applies to optimizer='sgd' only "
                                 f"(got {self.optimizer!r}).")
        if (self.epochs is None) == (self.steps is None):
            raise ValueError(f"Give exactly one of epochs and steps (got epochs={self.epochs!r}, "
                             f"steps={self.steps!r}).")
        for name in ("epochs", "steps", "steps_per_epoch", "batch_size", "backup_every",
                     "shuffle_buffer", "grad_norm_every", "train_examples", "val_examples"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "crop_padding", "randaugment_ops", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
        for name in ("learning_rate", "min_learning_rate", "weight_decay", "mixup", "cutmix"):
            self._check_range(name, 0.0, math.inf, "()" if name == "learning_rate" else "[)")
        for name in ("label_smoothing", "zoom", "val_fraction", "beta_1", "beta_2"):
            self._check_range(name, 0.0, 1.0, "()" if name == "val_fraction" else "[)")
        self._check_range("randaugment_factor", 0.0, 1.0, "[]")
        for name, high in (("grad_clip", math.inf), ("drop_path", 1.0)):
            if getattr(self, name) is not None:
                self._check_range(name, 0.0, high)
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(f"min_learning_rate={self.min_learning_rate} is above "
                             f"learning_rate={self.learning_rate}.")
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a dict of ViT config overrides, got {self.model!r}.")
        if "num_classes" in self.model:
            raise ValueError("model['num_classes'] is set from the dataset; remove it from the "
                             "overrides.")

    def _check_range(self, name, low, high, brackets="[)"):
        """Raises unless the setting `name` is in the interval `brackets` of `low`, `high`."""
        value = getattr(self, name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and (value > low if brackets[0] == "(" else value >= low)
                and (value <= high if brackets[1] == "]" else value < high)):
            raise ValueError(f"{name} must be a number in {brackets[0]}{low}, {high}{brackets[1]}, "
                             f"got {value!r}.")

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)
