"""High-resolution fine-tuning: a trained model at 384x384, as big_vision transfers.

The Dual PatchNorm paper reports its ImageNet models fine-tuned at 384x384 (Table 1),
with big_vision's transfer setup (`configs/transfer.py`): the trained weights with the
learned position embedding resampled to the new grid (`scipy.ndimage.zoom`, order 1:
`ViT.from_preset`'s default `resample="bilinear"`), a fresh zero head when the classes
change, SGD with momentum 0.9, no weight decay, global-norm clipping at 1.0, batch
512, 500 linear warm-up steps then cosine decay to zero, 20,000 steps on ImageNet,
random crops and flips, no MixUp, RandAugment or label smoothing. big_vision sweeps
the learning rate over {0.003, 0.01, 0.03}; 0.01 is its default and this recipe's.

Where this differs: big_vision's Inception crop becomes `crop="zoom"` up to 75% of
each side (as in `augreg_i1k`), and the momentum is kept in float32, not bfloat16.

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
