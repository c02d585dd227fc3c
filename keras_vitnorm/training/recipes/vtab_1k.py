"""VTAB-1k transfer: a trained model fine-tuned on 1,000 examples of a task.

VTAB-1k (Zhai et al. 2019) gives each task 800 training and 200 validation examples
from its training split and scores on its test split; the Dual PatchNorm paper sweeps
three learning rates with three seeds and chooses on validation. This recipe is one
run of that sweep, with the transfer setup of the ViT papers: SGD with momentum 0.9,
no weight decay, global-norm clipping at 1.0, batch 512, 2,500 steps with 200 linear
warm-up steps then cosine decay, no augmentation, the model at its own resolution.
`keras-vitnorm vtab` runs the whole sweep (rates 0.001, 0.003 and 0.01 by default)
over a list of datasets and writes one table; see docs/transfer.md.

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
