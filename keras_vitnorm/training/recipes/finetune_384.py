"""High-resolution fine-tuning: a trained model at 384x384, as big_vision transfers.

The Dual PatchNorm paper's 384x384 fine-tuning (Table 1) with big_vision's
`configs/transfer.py`: SGD with momentum 0.9, no weight decay, 20,000 steps of batch
512, learning rate 0.01 (big_vision's default of its {0.003, 0.01, 0.03} sweep). It
differs in `crop="zoom"` for the Inception crop and float32 momentum; the setting by
setting comparison: docs/transfer.md.

    keras-vitnorm train --recipe finetune_384 --preset runs/b16_dpn/preset \\
        --dataset tfds:imagenet2012 --manual-dir ~/imagenet_archives --distribute
"""

RECIPE = {
    "preset": None,
    "model": {},
    # Applied when --preset is a preset directory or a checkpoint (always, here).
    "checkpoint_model": {"image_size": 384},
    "dataset": "tfds:imagenet2012",
    "val_fraction": 0.01,
    "steps": 20_000,
    "steps_per_epoch": 1000,
    "batch_size": 512,
    "optimizer": "sgd",
    "momentum": 0.9,
    "learning_rate": 0.01,
    "warmup_steps": 500,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "label_smoothing": 0.0,
    "crop": "zoom",
    "zoom": 0.75,
    "flip": True,
}
