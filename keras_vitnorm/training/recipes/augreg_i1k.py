"""ImageNet-1k from scratch as the Dual PatchNorm paper trained its baselines.

Kumar et al. (2023) use the AugReg setup of Steiner et al. (2021), big_vision's
`configs/vit_i1k.py`: batch 4096, 300 epochs of `train[:99%]` (about 93k steps), Adam
(beta2 0.999) at 1e-3 with 10k warm-up steps then cosine to zero, decoupled weight
decay 1e-4 on kernels, clipping at 1.0, Inception crop, flip, RandAugment(2, 15) and
MixUp(0.5) ("medium2"), selection on `train[99%:]`, test on `validation`.

How the figures map onto Keras:
- Weight decay: Keras AdamW adds `learning_rate * weight_decay * w`, big_vision
  `wd * schedule * w`, so `weight_decay = 1e-4 / 1e-3 = 0.1` is the same decay.
- Inception crop: Keras core has no RandomResizedCrop; `crop="zoom"` up to 75% of each
  side (down to about 6% of the area) approximates it.
- RandAugment: Keras' `factor` is not TF's magnitude scale; its default 0.5 is used,
  not calibrated against big_vision's 15.
- Left out: big_vision's pre-logits layer (`rep_size=True`) and bfloat16 Adam moments.
- `steps_per_epoch` (1000) is an evaluation and backup interval, not a pass over the data.

    keras-vitnorm train --recipe augreg_i1k --preset b16_dpn \\
        --manual-dir ~/imagenet_archives --mixed-precision mixed_bfloat16 --distribute
"""

RECIPE = {
    "preset": "b16_dpn",
    "model": {},
    "dataset": "tfds:imagenet2012",
    "val_fraction": 0.01,
    "steps": 93_000,
    "steps_per_epoch": 1000,
    "batch_size": 4096,
    "learning_rate": 1e-3,
    "warmup_steps": 10_000,
    "weight_decay": 0.1,
    "beta_2": 0.999,
    "grad_clip": 1.0,
    "label_smoothing": 0.0,
    "crop": "zoom",
    "zoom": 0.75,
    "flip": True,
    "randaugment_ops": 2,
    "randaugment_factor": 0.5,
    "mixup": 0.5,
    "shuffle_buffer": 250_000,
}
