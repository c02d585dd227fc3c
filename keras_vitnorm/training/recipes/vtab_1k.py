"""VTAB-1k transfer: a trained model fine-tuned on 1,000 examples of a task.

VTAB-1k (Zhai et al. 2019): 800 training and 200 validation examples of each task's
training split, scored on its test split. One run of the Dual PatchNorm paper's sweep,
with the ViT papers' transfer setup; `keras-vitnorm vtab` runs the sweep (docs/transfer.md).

    keras-vitnorm vtab --presets runs/b16/preset runs/b16_dpn/preset \\
        --datasets tfds:cifar100 tfds:caltech101 tfds:dtd --output-dir runs/vtab
"""

RECIPE = {
    "preset": None,
    "model": {},
    "dataset": "tfds:cifar100",
    "train_examples": 800,
    "val_examples": 200,
    "steps": 2500,
    "steps_per_epoch": 250,
    "batch_size": 512,
    "optimizer": "sgd",
    "momentum": 0.9,
    "learning_rate": 0.01,
    "warmup_steps": 200,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "label_smoothing": 0.0,
    "crop": "none",
    "flip": False,
}
