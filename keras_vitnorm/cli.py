"""The `keras-vitnorm` command: `train`, `ablate`, `ablate-job`, `evaluate`, `convert`,
`segment`, `vtab` and `lit`.

The Keras backend is chosen by the `KERAS_BACKEND` environment variable, as for any
Keras program: `KERAS_BACKEND=jax keras-vitnorm train`.
"""

import argparse
import json
import sys
from dataclasses import replace as dataclasses_replace

from keras_vitnorm.choices import BLOCK_STYLES
from keras_vitnorm.choices import CROP_MODES
from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.choices import INPUT_PIPELINES
from keras_vitnorm.choices import NORM_TYPES
from keras_vitnorm.choices import OPTIMIZERS
from keras_vitnorm.choices import PLACEMENTS
from keras_vitnorm.choices import PRECISIONS
from keras_vitnorm.choices import RECIPE_NAMES
from keras_vitnorm.choices import RESAMPLE_METHODS
from keras_vitnorm.choices import STEM_NORM_TYPES
from keras_vitnorm.choices import STEM_TYPES
from keras_vitnorm.choices import VARIANT_GROUP_NAMES

ABLATE_EXAMPLES = """examples:
  keras-vitnorm ablate --groups placements stems --seeds 0 1 2 --output-dir studies/digits
  keras-vitnorm ablate --groups stems --variants stems:dual_patchnorm stems:conv \\
      --dataset folder:/data/cifar10 --epochs 30 --output-dir studies/cifar

  keras-vitnorm ablate --groups converged --lr-sweep 5e-4 1e-3 2e-3 --seeds 0 1 2 \
      --dataset folder:/data/cifar10 --epochs 30 --output-dir studies/cifar-lr
  keras-vitnorm ablate --groups stems --output-dir studies/digits --plan
      # one command per run in studies/digits/plan/commands.txt, for a scheduler

The base is the small recipe with the plain ti16 preset unless --preset/--recipe say
otherwise; every training option of `train` applies to every run. See docs/study.md.
"""

TRAIN_EXAMPLES = """examples:
  keras-vitnorm train                                   # small DPN ViT on digits (default recipe)
  keras-vitnorm train --norm rmsnorm --stem patch       # same recipe, other normalization
  keras-vitnorm train --dataset tfds:cifar10 --image-size 32 --epochs 100 --flip
  keras-vitnorm train --dataset folder:/data/flowers --preset s16_dpn --image-size 224 \\
      --patch-size 16 --width 384 --mlp-dim 1536 --depth 12   # S/16 as it is: the default
                                        # recipe cuts any preset to its small size
  keras-vitnorm train --recipe augreg_i1k --manual-dir ~/imagenet --distribute
  keras-vitnorm train --recipe finetune_384 --preset runs/b16/preset --manual-dir ~/imagenet
  keras-vitnorm train --output-dir runs/a --resume      # continue an interrupted run

Settings not given here come from the recipe (--recipe); see docs/training.md.
The Keras backend comes from KERAS_BACKEND (jax, tensorflow or torch).
"""

CONVERT_EXAMPLES = """examples:
  keras-vitnorm convert ~/hf/vit-base-patch16-224 presets/b16_hf
  keras-vitnorm convert ViT-B_16.npz presets/b16_augreg_384 --image-size 384
  keras-vitnorm convert vit_small_patch16_224.safetensors presets/s16_dpn_ft \\
      --stem dual_patchnorm --num-classes 10

Load the result with keras_vitnorm.ViT.from_preset(DESTINATION); see docs/checkpoints.md.
"""

SEGMENT_EXAMPLES = """examples:
  keras-vitnorm segment --stem dual_patchnorm --seeds 0 1 2 --output-dir runs/seg-dpn
  keras-vitnorm segment --dataset folder:/data/scenes --num-classes 5 --preset s16_dpn \\
      --image-size 224 --output-dir runs/scenes

The default dataset, digit_scenes, is composed offline from scikit-learn's digits; see
docs/segmentation.md.
"""

VTAB_EXAMPLES = """examples:
  keras-vitnorm vtab --presets runs/b16/preset runs/b16_dpn/preset \\
      --datasets tfds:cifar100 tfds:caltech101 tfds:dtd --output-dir runs/vtab
  keras-vitnorm vtab --presets runs/a/preset --datasets digits folder:/data/flowers \\
      --batch-size 64 --steps 300 --image-size 32 --output-dir runs/vtab-cpu

Each task: 800 train + 200 validation examples of its training split, scored on its
test split; the rate with the best mean validation accuracy is reported (vtab.md).
See docs/transfer.md.
"""

LIT_EXAMPLES = """examples:
  keras-vitnorm lit --preset runs/plain/preset --seeds 0 1 2 --output-dir runs/lit-plain
  keras-vitnorm lit --preset runs/dpn/preset --dataset folder:/data/cifar10 --loss sigmoid \\
      --output-dir runs/lit-dpn

The image tower is frozen (LiT) unless --trainable-image-tower; zero-shot accuracy is
scored on the test split with prompt templates held out of training. See
docs/contrastive.md.
"""

# (flag, ViT config key, type, choices, help)
MODEL_FLAGS = (
    ("--image-size", "image_size", int, None, "input height and width in pixels"),
    ("--patch-size", "patch_size", int, None, "patch side in pixels"),
    ("--width", "width", int, None, "token width"),
    ("--depth", "depth", int, None, "number of encoder blocks"),
    ("--num-heads", "num_heads", int, None, "attention heads"),
    ("--mlp-dim", "mlp_dim", int, None, "MLP hidden width"),
    ("--norm", "norm", str, NORM_TYPES, "norm inside the blocks and the final norm"),
    ("--attn-norm", "attn_norm", str, PLACEMENTS, "placement of the attention norm"),
    ("--mlp-norm", "mlp_norm", str, PLACEMENTS, "placement of the MLP norm"),
    ("--block-style", "block_style", str, BLOCK_STYLES, "extra norms / residual scaling"),
    ("--stem", "stem", str, STEM_TYPES, "patch embedding (dual_patchnorm = DPN)"),
    ("--stem-norm", "stem_norm", str, STEM_NORM_TYPES, "norm type inside the stem"),
    ("--pooling", "pooling", str, ("cls", "gap"), "class token or mean of tokens"),
    ("--layer-scale", "layer_scale", float, None, "LayerScale init value"),
)


#: Added to each --verbose help: the console command hides the frameworks' log lines.
LOGS_NOTE = "; 2 also lets TensorFlow's, XLA's and Abseil's own log lines through"


def _model_flag_help(key, choices, text):
    return f"{text} ({', '.join(choices)})" if choices else text


def _parse_setting(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        value = json.loads(value)
    except json.JSONDecodeError:
        pass  # a bare string such as norm=rmsnorm
    return key.strip(), value


def add_training_arguments(parser):
    """Adds the options shared by `train` and `ablate`: model, data, optimization, augmentation."""
    what = parser.add_argument_group("what to train")
    what.add_argument("--recipe", choices=RECIPE_NAMES, default="small",
                      help="named set of defaults (default: small)")
    what.add_argument("--preset", help="built-in preset name (see docs/presets.md), or a preset "
                      "directory or standard ViT checkpoint to fine-tune from "
                      "(docs/checkpoints.md; recipe default: ti16_dpn)")
    what.add_argument("--dataset", help="digits | tfds:<name> | folder:<path> (default: digits)")
    what.add_argument("--val-fraction", type=float,
                      help="training share held out for validation if the dataset has no "
                      "validation split (default 0.1)")
    what.add_argument("--train-examples", type=int,
                      help="train on a subset of this many training examples (stratified "
                      "by class, seed 0; tfds: the first ones). Default: all")
    what.add_argument("--val-examples", type=int,
                      help="validate on this many training examples held apart from the "
                      "--train-examples, instead of the dataset's validation split")
    what.add_argument("--skip-bad-images", action="store_true", default=None,
                      help="folder datasets: leave out (and list) files that are not whole "
                      "images instead of stopping with their names")
    what.add_argument("--data-dir", help="tensorflow-datasets data directory")
    what.add_argument("--manual-dir", help="folder of manually downloaded archives "
                      "(imagenet2012)")
    what.add_argument("--input-pipeline", choices=INPUT_PIPELINES, default=None,
                      help="tf.data, or python (Keras' PyDataset: digits and folders without "
                      "TensorFlow); auto (default): tf.data where TensorFlow is installed")

    model = parser.add_argument_group("model overrides (on top of the preset)")
    for flag, key, kind, choices, text in MODEL_FLAGS:
        model.add_argument(flag, dest=f"model_{key}", type=kind, choices=choices,
                           help=_model_flag_help(key, choices, text))
    model.add_argument("--qk-norm", dest="model_qk_norm", action="store_true", default=None,
                       help="normalize queries and keys per head")
    model.add_argument("--weight-standardization", dest="model_weight_standardization",
                       action="store_true", default=None,
                       help="standardize every stem and block kernel per output unit in the "
                       "forward pass (Qiao et al. 2019)")
    model.add_argument("--set", dest="model_set", action="append", type=_parse_setting,
                       default=[], metavar="KEY=VALUE",
                       help="any other ViT config value, e.g. --set final_norm=false "
                       "(JSON values); repeatable")

    schedule = parser.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, help="training length in epochs")
    schedule.add_argument("--steps", type=int, help="training length in steps (instead of epochs)")
    schedule.add_argument("--steps-per-epoch", type=int,
                          help="steps between validations and backups (default: one pass)")
    schedule.add_argument("--batch-size", type=int, help="global batch size")
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float,
                          help="peak learning rate")
    schedule.add_argument("--warmup-steps", type=int, help="linear warm-up steps from 0")
    schedule.add_argument("--min-lr", dest="min_learning_rate", type=float,
                          help="learning rate at the end of the cosine decay (default 0)")
    schedule.add_argument("--weight-decay", type=float,
                          help="AdamW decoupled weight decay (Keras convention: times the "
                          "learning rate); kernels only")
    schedule.add_argument("--optimizer", choices=OPTIMIZERS,
                          help="adamw (default) or sgd (with momentum, for fine-tuning)")
    schedule.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    schedule.add_argument("--beta1", dest="beta_1", type=float, help="Adam beta_1")
    schedule.add_argument("--beta2", dest="beta_2", type=float, help="Adam beta_2")
    schedule.add_argument("--grad-clip", type=float, help="global-norm clipping, 0 = off")
    schedule.add_argument("--label-smoothing", type=float, help="label smoothing in [0, 1)")
    schedule.add_argument("--drop-path", type=float, help="stochastic depth rate of the last block")
    schedule.add_argument("--mixed-precision", choices=PRECISIONS, help="dtype policy")
    schedule.add_argument("--seed", type=int, help="seed of weights, data order, augmentation")

    schedule.add_argument("--grad-norm-every", type=int,
                          help="record per-layer gradient norms every N steps (grad_norms.csv)")

    augment = parser.add_argument_group("augmentation (Keras preprocessing layers)")
    augment.add_argument("--crop", choices=CROP_MODES,
                         help="pad = zero-pad then random crop; zoom = random zoom-in")
    augment.add_argument("--crop-padding", type=int, help="pixels of padding for --crop pad")
    augment.add_argument("--zoom", type=float, help="largest zoom-in for --crop zoom")
    augment.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                         help="random horizontal flips")
    augment.add_argument("--randaugment-ops", type=int, help="RandAugment ops per image, 0 = off")
    augment.add_argument("--randaugment-factor", type=float, help="RandAugment strength in [0, 1]")
    augment.add_argument("--mixup", type=float, help="MixUp alpha, 0 = off")
    augment.add_argument("--cutmix", type=float, help="CutMix alpha, 0 = off")


def _add_seed_run_arguments(parser):
    """The run options of the commands that train one run directory per seed."""
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", required=True, help="one seed_<n>/ run directory per seed")
    run.add_argument("--overwrite", action="store_true", help="replace finished runs (default: skip them)")
    run.add_argument("--take-over-lock", action="store_true",
                     help="take over a run directory whose lock was left by a process that no longer runs")
    run.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                     help="0 silent, 1 progress bar (default), 2 one line per epoch" + LOGS_NOTE)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-vitnorm",
        allow_abbrev=False,
        description="Train and evaluate Vision Transformers whose normalization is a config choice.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train a ViT (default: a small DPN ViT on the bundled digits)",
        description="Train a ViT preset on a dataset with model.fit.",
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_training_arguments(train)
    run = train.add_argument_group("run")
    run.add_argument("--output-dir", help="run directory (default runs/<preset>-<dataset>-<time>)")
    overwrite = run.add_mutually_exclusive_group()
    overwrite.add_argument("--resume", action="store_true",
                           help="continue the interrupted run in --output-dir")
    overwrite.add_argument("--overwrite", action="store_true",
                           help="delete an existing --output-dir and start again")
    run.add_argument("--take-over-lock", action="store_true",
                     help="take over a run directory whose lock was left by a process that "
                     "no longer runs")
    run.add_argument("--backup-every", type=int,
                     help="steps between mid-epoch backups (default: each epoch end)")
    run.add_argument("--shuffle-buffer", type=int,
                     help="tf.data shuffle buffer size (the python pipeline shuffles whole passes)")
    run.add_argument("--distribute", nargs="?", const="data", choices=DISTRIBUTIONS, default=None,
                     help="data: data-parallel over all local devices (JAX, TensorFlow), or over "
                     "the processes torchrun started (PyTorch); the default when the flag is "
                     "given alone. fsdp: also shard every block kernel and its optimizer state "
                     "over the devices (JAX)")
    run.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                     help="do not write TensorBoard logs")
    run.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                     help="0 silent, 1 progress bar (default), 2 one line per epoch" + LOGS_NOTE)

    ablate = commands.add_parser(
        "ablate",
        allow_abbrev=False,
        help="run the normalization study: variant groups x seeds, tables and figures",
        description="Train every variant of the chosen groups with every seed on top of "
        "a base recipe, then write results.csv, a markdown table per group and figures. "
        "Rerunning the same command skips finished runs and resumes interrupted ones.",
        epilog=ABLATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    study = ablate.add_argument_group("study")
    study.add_argument("--groups", nargs="+", required=True, choices=VARIANT_GROUP_NAMES,
                       help="variant groups to run")
    study.add_argument("--variants", nargs="+", default=[], metavar="GROUP:NAME",
                       help="run only these variants (the group's baseline is always run)")
    study.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    study.add_argument("--output-dir", dest="study_dir", required=True, help="study directory")
    study.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                       help="0 silent, 1 one line per run (default), 2 also Keras' per-epoch lines"
                       + LOGS_NOTE)
    study.add_argument("--take-over-lock", action="store_true",
                       help="take over a study (and its runs) whose lock was left by a process "
                       "that no longer runs")
    study.add_argument("--parallel", type=int, default=1, metavar="N",
                       help="train N runs at once, each in its own process with its output in "
                       "<output-dir>/logs/ (default 1: one after another)")
    study.add_argument("--threads-per-run", type=int, metavar="K",
                       help="compute threads of each parallel run (default: the CPU cores "
                       "shared out over --parallel)")
    study.add_argument("--tables-only", action="store_true",
                       help="train nothing: write the tables and figures from the runs that "
                       "have finished, naming the others (a study part-way re-tabled, or the "
                       "runs of a --plan collected)")
    study.add_argument("--plan", action="store_true",
                       help="train nothing: write <output-dir>/plan/commands.txt, one command "
                       "per run that can train now (`keras-vitnorm ablate-job FILE`), for any "
                       "scheduler to run; --tables-only then collects the finished runs")
    study.add_argument("--lr-sweep", nargs="+", type=float, metavar="LR",
                       help="train every variant at each of these peak learning rates first "
                       "(with --sweep-seeds), then compare each at the rate with its best final "
                       "validation accuracy (<group>_lr_selection.md)")
    study.add_argument("--sweep-seeds", nargs="+", type=int, metavar="SEED",
                       help="seeds of the --lr-sweep runs (default: the first of --seeds)")
    add_training_arguments(ablate)

    job = commands.add_parser(
        "ablate-job",
        allow_abbrev=False,
        help="train one run of a study's plan (a line of <study>/plan/commands.txt)",
        description="Train, resume or skip (if finished) the one study run a job file of "
        "`ablate --plan` describes. Safe to run again at any time.",
    )
    job.add_argument("job_file", metavar="JOB_FILE", help="a <study>/plan/*.job.json file")
    job.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                     help="0 silent, 1 progress bar, 2 one line per epoch (default)" + LOGS_NOTE)

    evaluate = commands.add_parser(
        "evaluate",
        allow_abbrev=False,
        help="score a saved model on a dataset split",
        description="Score a preset directory (or a run directory from `train`) on a dataset.",
    )
    evaluate.add_argument("path", help="preset directory, or run directory (uses its preset/)")
    evaluate.add_argument("--dataset", help="digits | tfds:<name> | folder:<path> "
                          "(default: the run's dataset)")
    evaluate.add_argument("--split", choices=("test", "validation", "train"), default="test")
    evaluate.add_argument("--batch-size", type=int, default=256)
    evaluate.add_argument("--val-fraction", type=float, help="as used in training")
    evaluate.add_argument("--data-dir")
    evaluate.add_argument("--manual-dir")
    evaluate.add_argument("--json", action="store_true", help="print the result as JSON")
    evaluate.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                          help="0 no progress bar, 1 progress bar (default), 2 one line" + LOGS_NOTE)

    convert = commands.add_parser(
        "convert",
        allow_abbrev=False,
        help="convert a standard ViT checkpoint into a keras_vitnorm preset directory",
        description="Read a Hugging Face model directory, a keras-hub ViT preset, a timm or "
        "Hugging Face .safetensors/.pth file or a big_vision/AugReg .npz, and write it as a "
        "keras_vitnorm preset (ViT.from_preset(DST)). Overrides change the image size "
        "(position embedding resampled), the classes (new head) or the normalization "
        "(fine-tuning a plain checkpoint into a variant); the report lists every new and "
        "dropped weight.",
        epilog=CONVERT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("source", help="checkpoint file or directory")
    convert.add_argument("destination", help="preset directory to write")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a preset already in DESTINATION")
    convert.add_argument("--verbose", type=int, choices=(1, 2), default=1,
                         help="1 the conversion report (default), 2 also the frameworks' log lines")
    convert.add_argument("--num-classes", dest="model_num_classes", type=int,
                         help="classes of a new head (0 = features only)")
    convert.add_argument("--resample", choices=RESAMPLE_METHODS, default="bilinear",
                         help="how --image-size resamples the position embedding: bilinear "
                         "(big_vision, default) or bicubic (timm)")
    overrides = convert.add_argument_group("model overrides (normalization and image size)")
    for flag, key, kind, choices, text in MODEL_FLAGS:
        if key in ("width", "depth", "mlp_dim", "patch_size", "pooling"):
            continue  # fixed by the checkpoint
        overrides.add_argument(flag, dest=f"model_{key}", type=kind, choices=choices,
                               help=_model_flag_help(key, choices, text) + (
                                   " (only for state dicts that do not record it)"
                                   if key == "num_heads" else ""))
    overrides.add_argument("--qk-norm", dest="model_qk_norm", action="store_true", default=None,
                           help="normalize queries and keys per head")
    overrides.add_argument("--set", dest="model_set", action="append", type=_parse_setting,
                           default=[], metavar="KEY=VALUE", help="any other ViT config value")
    vtab = commands.add_parser(
        "vtab",
        allow_abbrev=False,
        help="VTAB-1k transfer: fine-tune presets on 1,000 examples per task, rate sweep x seeds",
        description="Fine-tune every preset on every dataset with 800 training and 200 validation "
        "examples (VTAB-1k), at each learning rate and seed; choose the rate on validation and "
        "write the test accuracy table (vtab.md). Rerunning skips finished runs.",
        epilog=VTAB_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep = vtab.add_argument_group("sweep")
    sweep.add_argument("--presets", nargs="+", required=True,
                       help="trained models: preset directories or checkpoints")
    sweep.add_argument("--datasets", nargs="+", required=True, help="tfds:<name> | folder:<path> | digits")
    sweep.add_argument("--lrs", dest="learning_rates", nargs="+", type=float, default=[0.001, 0.003, 0.01],
                       help="learning rates swept (default 0.001 0.003 0.01)")
    sweep.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    sweep.add_argument("--output-dir", dest="sweep_dir", required=True, help="sweep directory")
    sweep.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1,
                       help="0 silent, 1 one line per run (default), 2 also Keras' per-epoch lines"
                       + LOGS_NOTE)
    sweep.add_argument("--take-over-lock", action="store_true",
                       help="take over a sweep whose lock was left by a process that no longer runs")
    sweep.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                       help="do not write TensorBoard logs")
    add_training_arguments(vtab)
    vtab.set_defaults(recipe="vtab_1k")

    lit = commands.add_parser(
        "lit",
        allow_abbrev=False,
        help="contrastive image-text training with a frozen ViT tower (LiT), zero-shot accuracy",
        description="Train a text transformer from scratch against a ViT image tower (frozen by "
        "default) on a classification dataset's images captioned from templates, with the "
        "softmax or sigmoid contrastive loss and a learned temperature; report zero-shot "
        "test accuracy with held-out prompt templates per seed and the mean with a 95% CI.",
        epilog=LIT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lit.add_argument("--preset", default="ti16", help="image tower: preset directory, checkpoint or name")
    lit.add_argument("--dataset", default="digits", help="digits (default) | tfds:<name> | folder:<path>")
    lit.add_argument("--image-size", type=int, default=32)
    lit.add_argument("--train-examples", type=int, help="train on this many examples (default: all)")
    lit.add_argument("--trainable-image-tower", dest="freeze_image_tower", action="store_false",
                     help="train the image tower too (default: frozen, as LiT)")
    lit.add_argument("--loss", choices=("softmax", "sigmoid"), default="softmax")
    lit.add_argument("--set", dest="model_set", action="append", type=_parse_setting, default=[],
                     metavar="KEY=VALUE", help="image tower ViT overrides (for a built-in preset)")
    text = lit.add_argument_group("text tower and embedding")
    text.add_argument("--embed-dim", type=int, default=128)
    text.add_argument("--max-length", type=int, default=16)
    text.add_argument("--text-width", type=int, default=128)
    text.add_argument("--text-depth", type=int, default=2)
    text.add_argument("--text-heads", type=int, default=4)
    text.add_argument("--text-mlp-dim", type=int, default=512)
    schedule = lit.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, default=10)
    schedule.add_argument("--batch-size", type=int, default=64)
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    schedule.add_argument("--warmup-steps", type=int, default=50)
    schedule.add_argument("--weight-decay", type=float, default=0.05)
    schedule.add_argument("--seeds", nargs="+", type=int, default=[0])
    _add_seed_run_arguments(lit)

    segment = commands.add_parser(
        "segment",
        allow_abbrev=False,
        help="train a ViT with a linear segmentation head (mean IoU), one run per seed",
        description="Put a linear per-patch head on a ViT encoder (any preset or checkpoint), "
        "upsample its logits to the pixels, train with per-pixel cross-entropy through "
        "model.fit and report the test mean IoU of each seed and their mean with a 95% CI.",
        epilog=SEGMENT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    segment.add_argument("--dataset", default="digit_scenes",
                         help="digit_scenes (default, offline) | tfds:<name> | folder:<path>")
    segment.add_argument("--num-classes", type=int, help="pixel classes (tfds and folder datasets)")
    segment.add_argument("--preset", default="ti16",
                         help="encoder: preset name, preset directory or checkpoint (default ti16)")
    segment.add_argument("--scenes", type=int, nargs=3, default=(2000, 400, 400), metavar=("TRAIN", "VAL", "TEST"),
                         help="digit_scenes split sizes (default 2000 400 400)")
    model = segment.add_argument_group("model overrides (on top of the preset)")
    for flag, key, kind, choices, text in MODEL_FLAGS:
        model.add_argument(flag, dest=f"model_{key}", type=kind, choices=choices,
                           help=_model_flag_help(key, choices, text))
    model.add_argument("--set", dest="model_set", action="append", type=_parse_setting,
                       default=[], metavar="KEY=VALUE", help="any other ViT config value")
    schedule = segment.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, default=10)
    schedule.add_argument("--batch-size", type=int, default=32)
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    schedule.add_argument("--warmup-steps", type=int, default=100)
    schedule.add_argument("--weight-decay", type=float, default=0.05)
    schedule.add_argument("--mixed-precision", choices=PRECISIONS, default="float32")
    schedule.add_argument("--seeds", nargs="+", type=int, default=[0])
    _add_seed_run_arguments(segment)
    return parser


def _model_overrides(args):
    model = {key[len("model_"):]: value for key, value in vars(args).items()
             if key.startswith("model_") and key != "model_set" and value is not None}
    for key, value in args.model_set:
        model[key] = value
    return model


def train_config_from_args(args):
    """The `TrainConfig` that parsed `train` arguments describe."""
    from keras_vitnorm.training import TrainConfig

    model = _model_overrides(args)
    settings = {
        key: value
        for key, value in vars(args).items()
        if key in TrainConfig.field_names() and key not in ("recipe", "model")
    }
    return TrainConfig.from_recipe(args.recipe, model=model, **settings)


def _fail(parser, command, message, code=2):
    print(f"{parser.prog} {command}: error: {message}", file=sys.stderr)
    return code


def main(argv=None, hide_framework_logs=False):
    """Runs the command line; returns the exit status (0 success, 1 a run of a parallel
    study failed (its log is named), 2 bad arguments, bad
    input files or a run directory in use, 3 diverged, 4 a file could not be written
    (full disk, permissions; the last checkpoint is intact), 130 interrupted).

    With `hide_framework_logs` (the console command), the frameworks' own log lines
    are kept off stderr unless `--verbose 2` (`keras_vitnorm.framework_logs`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if hide_framework_logs and args.verbose < 2:
        from keras_vitnorm import framework_logs

        with framework_logs.hidden():
            return _run(parser, args)
    return _run(parser, args)


def _run(parser, args):
    if args.command == "train":
        return _train(parser, args)
    if args.command == "ablate":
        return _ablate(parser, args)
    if args.command == "ablate-job":
        return _ablate_job(parser, args)
    if args.command == "convert":
        return _convert(parser, args)
    if args.command == "segment":
        return _segment(parser, args)
    if args.command == "vtab":
        return _vtab(parser, args)
    if args.command == "lit":
        return _lit(parser, args)
    return _evaluate(parser, args)


def _convert(parser, args):
    import os

    from keras_vitnorm.convert import is_checkpoint
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models import load_checkpoint
    from keras_vitnorm.models.preset_io import CONFIG_FILE

    overrides = {key[len("model_"):]: value for key, value in vars(args).items()
                 if key.startswith("model_") and key != "model_set" and value is not None}
    overrides.update(dict(args.model_set))
    num_heads = overrides.pop("num_heads", None)
    if os.path.exists(os.path.join(args.destination, CONFIG_FILE)) and not args.overwrite:
        return _fail(parser, "convert", f"{args.destination!r} already holds a preset "
                     f"({CONFIG_FILE}); pass --overwrite to replace it.")
    try:
        if os.path.isdir(args.source) and not is_checkpoint(args.source):
            # A keras_vitnorm preset: re-saved with the overrides (a new size or head).
            if num_heads is not None:
                raise ValueError(f"--num-heads does not apply: {args.source!r} is a "
                                 "keras_vitnorm preset, which records its head count.")
            model, report = ViT.from_preset(args.source, resample=args.resample, **overrides), None
        else:
            model, report = load_checkpoint(
                args.source, num_heads=num_heads, resample=args.resample, **overrides
            )
        model.save_to_preset(args.destination, overwrite=args.overwrite)
    except (ValueError, OSError) as error:
        return _fail(parser, "convert", str(error))
    if report is not None:
        print(report)
    print(f"Wrote {args.destination} ({model.count_params():,} parameters); load it with "
          f"ViT.from_preset({args.destination!r}).")
    return 0


def _ablate(parser, args):
    from keras_vitnorm.study import markdown_table
    from keras_vitnorm.study.workers import STORAGE_EXIT_CODE
    from keras_vitnorm.study.workers import RunsFailed
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError
    from keras_vitnorm.study import run_study
    from keras_vitnorm.study import summarize

    try:
        if args.preset is None and args.recipe == "small":
            args.preset = "ti16"  # the study's baseline is the plain ViT
        args.output_dir = None
        config = train_config_from_args(args)
        variants = {}
        for item in args.variants:
            group, _, name = item.partition(":")
            if group not in args.groups or not name:
                raise ValueError(
                    f"--variants {item!r} must be GROUP:NAME with GROUP one of --groups "
                    f"({', '.join(args.groups)})."
                )
            variants.setdefault(group, []).append(name)
        if config.grad_norm_every is None:
            config.grad_norm_every = 25
        if args.tables_only and args.plan:
            raise ValueError("--tables-only and --plan are two ways of training nothing: "
                             "give one.")
        mode = "tables" if args.tables_only else "plan" if args.plan else "train"
        rows = run_study(config, args.groups, args.seeds, args.study_dir, variants, args.verbose,
                         take_over_lock=args.take_over_lock, parallel=args.parallel,
                         threads_per_run=args.threads_per_run, mode=mode,
                         lr_sweep=args.lr_sweep, sweep_seeds=args.sweep_seeds)
    except RunsFailed as error:
        codes = {code for _, code in error.failures}
        return _fail(parser, "ablate", str(error),
                     code=STORAGE_EXIT_CODE if codes == {STORAGE_EXIT_CODE} else 1)
    except StorageError as error:
        return _fail(parser, "ablate", str(error), code=4)
    except (ValueError, FileExistsError, LockedError) as error:
        return _fail(parser, "ablate", str(error))
    except KeyboardInterrupt:
        return _fail(parser, "ablate", "interrupted. Rerun the same command to continue.", code=130)
    if mode == "plan":
        return 0
    for group in args.groups:
        group_rows = [r for r in rows if r["group"] == group]
        if group_rows:
            print(f"\n{group}\n" + markdown_table(summarize(group_rows)))
    return 0


def _ablate_job(parser, args):
    from keras_vitnorm.study.plan import run_job
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError

    try:
        row = run_job(args.job_file, verbose=args.verbose)
    except StorageError as error:
        return _fail(parser, "ablate-job", str(error), code=4)
    except (ValueError, LockedError) as error:
        return _fail(parser, "ablate-job", str(error))
    except KeyboardInterrupt:
        return _fail(parser, "ablate-job", "interrupted. Run the same command to continue.",
                     code=130)
    if args.verbose:
        print(f"[{row['group']}] {row['variant']} seed {row['seed']}: {row['status']}, test "
              f"accuracy {row['test_accuracy']}")
    return 0


def _train(parser, args):
    from keras_vitnorm.training import TrainingDiverged
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError
    from keras_vitnorm.training import train

    try:
        config = train_config_from_args(args)
        metrics = train(config, resume=args.resume, overwrite=args.overwrite,
                        verbose=args.verbose, take_over_lock=args.take_over_lock)
    except TrainingDiverged as error:
        return _fail(parser, "train", str(error), code=3)
    except StorageError as error:
        return _fail(parser, "train", str(error), code=4)
    except (ValueError, FileExistsError, LockedError) as error:
        return _fail(parser, "train", str(error))
    except KeyboardInterrupt:
        return _fail(parser, "train", "interrupted. Continue with the same command plus "
                     "--resume --output-dir <the run directory>.", code=130)
    if args.verbose:
        print(f"metrics: test_accuracy={metrics['test_accuracy']:.4f} "
              f"val_accuracy={metrics['val_accuracy']:.4f}")
    return 0


def _vtab(parser, args):
    from keras_vitnorm.study.vtab import run_vtab
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError

    for flag, value in (("--preset", args.preset), ("--dataset", args.dataset),
                        ("--train-examples", args.train_examples), ("--lr", args.learning_rate),
                        ("--seed", args.seed)):
        if value is not None:
            return _fail(parser, "vtab", f"{flag} is set by the sweep: use --presets, --datasets, "
                         "--lrs and --seeds (800 + 200 examples per task are the protocol).")
    args.preset, args.dataset = args.presets[0], args.datasets[0]
    try:
        base = train_config_from_args(args)
        for dataset in args.datasets[1:]:
            dataclasses_replace(base, dataset=dataset).validate()
        rows = run_vtab(base, args.presets, args.datasets, args.sweep_dir, args.learning_rates, args.seeds,
                        verbose=args.verbose, take_over_lock=args.take_over_lock)
    except StorageError as error:
        return _fail(parser, "vtab", str(error), code=4)
    except (ValueError, FileExistsError, LockedError) as error:
        return _fail(parser, "vtab", str(error))
    except KeyboardInterrupt:
        return _fail(parser, "vtab", "interrupted; the same command resumes the sweep.", code=130)
    import os

    from keras_vitnorm.study.vtab import vtab_table

    print(vtab_table(rows))
    print(f"written: {os.path.join(args.sweep_dir, 'vtab.md')}, {os.path.join(args.sweep_dir, 'vtab_results.csv')}")
    return 0


def _seeds_with_ci(parser, command, args, run, score, describe):
    """Runs `run(seed, run_dir)` per seed (a finished seed is read back unless --overwrite),
    prints each seed's `describe(metrics)` and the mean of `score` with a 95% CI."""
    import os

    from keras_vitnorm import durable
    from keras_vitnorm.study.stats import confidence_interval
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError

    scores = []
    try:
        for seed in args.seeds:
            run_dir = os.path.join(args.output_dir, f"seed_{seed}")
            metrics = durable.read_json(os.path.join(run_dir, "metrics.json"))
            if metrics and not args.overwrite:
                if args.verbose:
                    print(f"seed {seed}: finished earlier in {run_dir}")
            else:
                metrics = run(seed, run_dir)
            scores.append(metrics[score])
            print(f"seed {seed}: {describe(metrics)}")
    except StorageError as error:
        return _fail(parser, command, str(error), code=4)
    except (ValueError, FileExistsError, LockedError) as error:
        return _fail(parser, command, str(error))
    except KeyboardInterrupt:
        return _fail(parser, command, "interrupted; finished seeds are kept and the same "
                     "command runs the rest.", code=130)
    if len(scores) > 1:
        mean, half_width = confidence_interval(scores)
        print(f"{score} over {len(scores)} seeds: {mean:.4f} +- {half_width:.4f} (95% CI)")
    return 0


def _lit(parser, args):
    from keras_vitnorm.training.contrastive import LiTConfig
    from keras_vitnorm.training.contrastive import train_lit

    try:
        config = LiTConfig(
            dataset=args.dataset, preset=args.preset, image_size=args.image_size, model=dict(args.model_set),
            freeze_image_tower=args.freeze_image_tower, loss=args.loss, embed_dim=args.embed_dim,
            max_length=args.max_length, text_width=args.text_width, text_depth=args.text_depth,
            text_heads=args.text_heads, text_mlp_dim=args.text_mlp_dim, train_examples=args.train_examples,
            epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        )
    except ValueError as error:
        return _fail(parser, "lit", str(error))
    return _seeds_with_ci(
        parser, "lit", args,
        lambda seed, run_dir: train_lit(dataclasses_replace(config, seed=seed), run_dir, overwrite=args.overwrite,
                                        verbose=args.verbose, take_over_lock=args.take_over_lock),
        "zero_shot_test_accuracy",
        lambda m: (f"zero-shot test accuracy {m['zero_shot_test_accuracy']:.4f} (held-out templates), "
                   f"{m['zero_shot_test_accuracy_train_templates']:.4f} (training templates)"),
    )


def _segment(parser, args):
    from keras_vitnorm.training.segmentation import SegmentationConfig
    from keras_vitnorm.training.segmentation import train_segmenter
    from keras_vitnorm.training.segmentation_data import load_segmentation_data

    model = _model_overrides(args)
    image_size = model.pop("image_size", None) or 32
    try:
        config = SegmentationConfig(
            dataset=args.dataset, preset=args.preset, image_size=image_size, num_classes=args.num_classes,
            model=model, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
            warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
            mixed_precision=args.mixed_precision, scenes=tuple(args.scenes),
        )
        data = load_segmentation_data(config.dataset, config.image_size, config.num_classes, config.scenes)
    except ValueError as error:
        return _fail(parser, "segment", str(error))
    if args.verbose:
        print(data.describe())
    return _seeds_with_ci(
        parser, "segment", args,
        lambda seed, run_dir: train_segmenter(dataclasses_replace(config, seed=seed), run_dir,
                                              overwrite=args.overwrite, verbose=args.verbose, data=data,
                                              take_over_lock=args.take_over_lock),
        "test_mean_iou",
        lambda m: f"test mean IoU {m['test_mean_iou']:.4f}, pixel accuracy {m['test_pixel_accuracy']:.4f}",
    )


def _evaluate(parser, args):
    from keras_vitnorm.training import evaluate

    try:
        result = evaluate(args.path, args.dataset, args.split, args.batch_size,
                          args.val_fraction, args.data_dir, args.manual_dir,
                          verbose=0 if args.json else args.verbose)
    except (ValueError, OSError) as error:
        return _fail(parser, "evaluate", str(error))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['dataset']} {result['split']}: accuracy {result['accuracy']:.4f}, "
              f"loss {result['loss']:.4f} on {result['examples']} images")
    return 0


#: The commands that train: long CPU work whose step time the allocator setting changes.
TRAINING_COMMANDS = ("train", "ablate", "ablate-job", "segment", "vtab", "lit")


def console(argv=None):
    """Entry point of the `keras-vitnorm` console script, `python -m keras_vitnorm` and
    the scripts in `recipes/`: runs the command `argv` (default `sys.argv[1:]`) and exits
    with its status.

    Before a command that trains, it makes the process keep freed memory
    (`keras_vitnorm.host_memory.retain_freed_memory`; its effect on the training step
    is in docs/performance.md). `convert` and `evaluate` leave the allocator as it is.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in TRAINING_COMMANDS:
        from keras_vitnorm.host_memory import retain_freed_memory

        retain_freed_memory()
    sys.exit(main(argv, hide_framework_logs=True))


if __name__ == "__main__":
    console()
