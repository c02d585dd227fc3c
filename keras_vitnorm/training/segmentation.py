"""Training a `Segmenter` through `model.fit` with the classification trainer's AdamW
schedule: `keras-vitnorm segment` and its API (docs/segmentation.md)."""

import dataclasses
import time

import keras

from keras_vitnorm import backend
from keras_vitnorm.models.segmenter import PixelAccuracy
from keras_vitnorm.models.segmenter import Segmenter
from keras_vitnorm.models.segmenter import mean_iou
from keras_vitnorm.models.segmenter import segmentation_loss
from keras_vitnorm.models.vit import ViT
from keras_vitnorm.models.vit_config import in_model_range
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import dtype_policy
from keras_vitnorm.training.optimizer import adamw
from keras_vitnorm.training.segmentation_data import load_segmentation_data
from keras_vitnorm.training.segmentation_data import model_inputs
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int

MODEL_FILE = "segmenter.keras"


@dataclasses.dataclass
class SegmentationConfig:
    """What `train_segmenter` trains.

    Args:
        dataset, num_classes, scenes: as `load_segmentation_data` takes them.
        preset, model: the encoder's preset or checkpoint, and ViT config overrides.
        image_size: int, the input side; the position embedding is resampled to it.
        seed: seeds the head, any fresh encoder weights and the batch order.
    """

    dataset: str = "digit_scenes"
    preset: str = "ti16"
    image_size: int = 32
    num_classes: int = None
    model: dict = dataclasses.field(default_factory=dict)
    epochs: int = 10
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.05
    mixed_precision: str = "float32"
    seed: int = 0
    scenes: tuple = (2000, 400, 400)

    def __post_init__(self):
        for name in ("image_size", "epochs", "batch_size"):
            check_positive_int(name, getattr(self, name))
        check_positive_float("learning_rate", self.learning_rate)
        scenes = tuple(self.scenes)
        if len(scenes) != 3 or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in scenes):
            raise ValueError("scenes must be three positive integers (train, validation, test; "
                             f"--scenes), got {scenes}.")
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(f"weight_decay and warmup_steps must be >= 0, got "
                             f"{self.weight_decay} and {self.warmup_steps}.")


def build_segmenter(config, num_classes):
    """The `Segmenter` of `config`: the encoder from its preset, a fresh linear head."""
    overrides = in_model_range(  # segmentation_data feeds [-1, 1]
        {key: value for key, value in config.model.items() if key != "image_size"})
    with dtype_policy(config.mixed_precision):
        vit = ViT.from_preset(config.preset, image_size=config.image_size, **overrides)
        return Segmenter(vit, num_classes)


def train_segmenter(config, output_dir=None, overwrite=False, verbose=1, data=None,
                    take_over_lock=False):
    """Trains, evaluates on the test split and saves a segmenter; returns the metrics dict.

    Args:
        output_dir: where `segmenter.keras` and `metrics.json` go, locked while the run
            trains (None: nothing saved).
        overwrite: replace a finished run in `output_dir` (else an error).
        data: an already loaded `SegmentationData` (the seeds of one sweep share it).
        take_over_lock: take over `output_dir` from a process that no longer runs.
    """
    with run_files.results_run(output_dir, "segmentation run", overwrite, take_over_lock) as save:
        metrics, model = _train_segmenter(config, verbose, data)
        save(model, MODEL_FILE, metrics)
    return metrics


def _train_segmenter(config, verbose, data):
    data = data or load_segmentation_data(config.dataset, config.image_size, config.num_classes,
                                          config.scenes)
    keras.utils.set_random_seed(config.seed)
    model = build_segmenter(config, data.num_classes)
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = data.train, data.validation, data.test
    steps = config.epochs * -(-len(x_train) // config.batch_size)
    optimizer = adamw(model, steps, config.learning_rate, warmup_steps=config.warmup_steps,
                      weight_decay=config.weight_decay)
    model.compile(optimizer=optimizer, loss=segmentation_loss(data.ignore_class),
                  metrics=[mean_iou(data.num_classes, data.ignore_class),
                           PixelAccuracy(data.ignore_class)])
    started = time.time()
    history = model.fit(model_inputs(x_train), y_train, batch_size=config.batch_size,
                        epochs=config.epochs, validation_data=(model_inputs(x_val), y_val),
                        verbose=verbose)
    train_seconds = time.time() - started
    test = model.evaluate(model_inputs(x_test), y_test, batch_size=config.batch_size, verbose=0,
                          return_dict=True)
    metrics = {
        "status": "completed",
        "config": dataclasses.asdict(config),
        "dataset": data.describe(),
        "test_mean_iou": float(test["mean_iou"]),
        "test_pixel_accuracy": float(test["pixel_accuracy"]),
        "test_loss": float(test["loss"]),
        "history": {key: [float(v) for v in values] for key, values in history.history.items()},
        "train_seconds": round(train_seconds, 2),
        "backend": backend.name(),
    }
    return metrics, model

