"""The options several commands share, and the `TrainConfig` that parsed options describe."""

import argparse
import json

from keras_vitnorm.choices import BLOCK_STYLES
from keras_vitnorm.choices import CROP_MODES
from keras_vitnorm.choices import INPUT_PIPELINES
from keras_vitnorm.choices import NORM_TYPES
from keras_vitnorm.choices import OPTIMIZERS
from keras_vitnorm.choices import PLACEMENTS
from keras_vitnorm.choices import PRECISIONS
from keras_vitnorm.choices import RECIPE_NAMES
from keras_vitnorm.choices import STEM_NORM_TYPES
from keras_vitnorm.choices import STEM_TYPES
from keras_vitnorm.validation import did_you_mean

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
#: The --verbose levels of a command that trains one run, and of one that trains many.
PROGRESS_LEVELS = ("0 silent, 1 progress bar (default; one line per epoch where the output is "
                   "not a terminal), 2 one line per epoch")
PER_RUN_LEVELS = "0 silent, 1 one line per run (default), 2 also Keras' per-epoch lines"

#: The help of every command's --take-over-lock (keras_vitnorm.training.run_files.RunLock).
TAKE_OVER_LOCK_HELP = ("on a file system without file locks, take over a directory whose lock "
                       "file was left by a process that no longer runs (elsewhere a lock "
                       "ends with its process: nothing to take over)")


class Parser(argparse.ArgumentParser):
    """`ArgumentParser` whose error is one line, not argparse's full usage that hides it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def one_of(choices, registered=None):
    """`add_argument` keywords for one of `choices`, naming the closest spelling of a bad value;
    `registered` returns names allowed beside `choices` (a user's norms), asked only as needed."""
    def parse(text):
        names = [] if text in choices or not registered else registered()
        if text in choices or text in names:
            return text
        extra = (f", or a name registered by a module of KERAS_VITNORM_NORM_MODULES "
                 f"({', '.join(names) or 'none registered'})") if registered else ""
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r}.{did_you_mean(text, [*choices, *names])} Valid: "
            f"{', '.join(choices)}{extra}.")

    return {"type": parse, "metavar": "{" + ",".join(choices) + (",...}" if registered else "}")}


def add_verbose(group, levels, default=1):
    """`--verbose` 0, 1 or 2: `levels` says what each shows."""
    group.add_argument("--verbose", type=int, choices=(0, 1, 2), default=default,
                       help=levels + LOGS_NOTE)


def registered_norms():
    """The registered norm names, `KERAS_VITNORM_NORM_MODULES` imported (imports Keras)."""
    from keras_vitnorm.layers import normalization

    return normalization.registered_norms(import_modules=True)


def parse_setting(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        value = json.loads(value)
    except json.JSONDecodeError:
        pass  # a bare string such as norm=rmsnorm
    return key.strip(), value


def add_model_overrides(group, fixed=(), qk_norm=True, set_help=None, notes=None):
    """Adds `MODEL_FLAGS` not in `fixed` (`notes[key]` appended to a help), `--qk-norm` and,
    with `set_help`, `--set`."""
    notes = notes or {}
    for flag, key, kind, choices, text in MODEL_FLAGS:
        if key in fixed:
            continue
        if key in ("norm", "stem_norm"):
            kinds = one_of(choices, registered_norms)
            text += (f" ({', '.join(choices)}, or a name that a module of "
                     "KERAS_VITNORM_NORM_MODULES registers: docs/your-norm.md)")
        else:
            kinds = one_of(choices) if choices else {"type": kind}
            text += f" ({', '.join(choices)})" if choices else ""
        group.add_argument(flag, dest=f"model_{key}", **kinds, help=text + notes.get(key, ""))
    if qk_norm:
        group.add_argument("--qk-norm", dest="model_qk_norm", action="store_true", default=None,
                           help="normalize queries and keys per head")
    if set_help:
        add_set_option(group, set_help)


def add_set_option(group, help):
    """`--set KEY=VALUE`, repeatable: ViT config values (`model_set`, a list of pairs)."""
    group.add_argument("--set", dest="model_set", action="append", type=parse_setting,
                       default=[], metavar="KEY=VALUE", help=help)


def add_training_arguments(parser):
    """Adds the options shared by `train` and `ablate`: model, data, optimization, augmentation."""
    what = parser.add_argument_group("what to train")
    what.add_argument("--recipe", **one_of(RECIPE_NAMES), default="small",
                      help="named set of defaults (default: small)")
    what.add_argument("--preset", help="built-in preset name (see docs/presets.md), or a preset "
                      "directory or standard ViT checkpoint to fine-tune from "
                      "(docs/checkpoints.md; recipe default: ti16)")
    what.add_argument("--dataset", help="digits | tfds:<name> | folder:<path> (default: digits)")
    what.add_argument("--val-fraction", type=float, help="training share held out for validation "
                      "if the dataset has no validation split (default 0.1)")
    what.add_argument("--train-examples", type=int, help="train on a subset of this many training "
                      "examples (stratified by class, seed 0; tfds: the first ones). Default: all")
    what.add_argument("--val-examples", type=int,
                      help="validate on this many training examples held apart from the "
                      "--train-examples, instead of the dataset's validation split")
    what.add_argument("--skip-bad-images", action="store_true", default=None,
                      help="folder datasets: leave out (and list) files that are not whole "
                      "images instead of stopping with their names")
    what.add_argument("--data-dir", help="tensorflow-datasets data directory")
    what.add_argument("--manual-dir", help="folder of manually downloaded archives (imagenet2012)")
    what.add_argument("--input-pipeline", **one_of(INPUT_PIPELINES), default=None,
                      help="tf.data, or python (Keras' PyDataset: digits and folders without "
                      "TensorFlow); auto (default): tf.data where TensorFlow is installed")

    model = parser.add_argument_group("model overrides (on top of the preset)")
    add_model_overrides(model)
    model.add_argument("--weight-standardization", dest="model_weight_standardization",
                       action="store_true", default=None, help="standardize every stem and block "
                       "kernel per output unit in the forward pass (Qiao et al. 2019)")
    add_set_option(model, "any other ViT config value, e.g. --set final_norm=false (JSON "
                   "values); repeatable")

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
    schedule.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay (Keras "
                          "convention: times the learning rate); kernels only")
    schedule.add_argument("--optimizer", **one_of(OPTIMIZERS),
                          help="adamw (default) or sgd (with momentum, for fine-tuning)")
    schedule.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    schedule.add_argument("--beta1", dest="beta_1", type=float, help="Adam beta_1")
    schedule.add_argument("--beta2", dest="beta_2", type=float, help="Adam beta_2")
    schedule.add_argument("--grad-clip", type=float, help="global-norm clipping, 0 = off")
    schedule.add_argument("--label-smoothing", type=float, help="label smoothing in [0, 1)")
    schedule.add_argument("--drop-path", type=float, help="stochastic depth rate of the last block")
    schedule.add_argument("--mixed-precision", **one_of(PRECISIONS), help="dtype policy")
    schedule.add_argument("--seed", type=int, help="seed of weights, data order, augmentation")
    schedule.add_argument("--grad-norm-every", type=int,
                          help="record per-layer gradient norms every N steps (grad_norms.csv)")

    augment = parser.add_argument_group("augmentation (Keras preprocessing layers)")
    augment.add_argument("--crop", **one_of(CROP_MODES),
                         help="pad = zero-pad then random crop; zoom = random zoom-in")
    augment.add_argument("--crop-padding", type=int, help="pixels of padding for --crop pad")
    augment.add_argument("--zoom", type=float, help="largest zoom-in for --crop zoom")
    augment.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                         help="random horizontal flips")
    augment.add_argument("--randaugment-ops", type=int, help="RandAugment ops per image, 0 = off")
    augment.add_argument("--randaugment-factor", type=float, help="RandAugment strength in [0, 1]")
    augment.add_argument("--mixup", type=float, help="MixUp alpha, 0 = off")
    augment.add_argument("--cutmix", type=float, help="CutMix alpha, 0 = off")


def add_seed_run_arguments(parser, batch_size, warmup_steps, precision=False):
    """The optimization and run options of `segment` and `lit` (a run directory per seed)."""
    schedule = parser.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, default=10)
    schedule.add_argument("--batch-size", type=int, default=batch_size)
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    schedule.add_argument("--warmup-steps", type=int, default=warmup_steps)
    schedule.add_argument("--weight-decay", type=float, default=0.05)
    if precision:
        schedule.add_argument("--mixed-precision", **one_of(PRECISIONS), default="float32")
    schedule.add_argument("--seeds", nargs="+", type=int, default=[0])
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", required=True, help="one seed_<n>/ run directory per seed")
    run.add_argument("--overwrite", action="store_true",
                     help="replace finished runs (default: skip them)")
    run.add_argument("--take-over-lock", action="store_true", help=TAKE_OVER_LOCK_HELP)
    add_verbose(run, PROGRESS_LEVELS)


def model_overrides(args):
    """`{ViT config key: value}` of the model options given (`--set` ones last)."""
    model = {key[len("model_"):]: value for key, value in vars(args).items()
             if key.startswith("model_") and key != "model_set" and value is not None}
    return {**model, **dict(args.model_set)}


def train_config_from_args(args, **replaced):
    """The validated `TrainConfig` of parsed training arguments, `replaced` overriding them."""
    from keras_vitnorm.training import TrainConfig

    settings = {key: value for key, value in {**vars(args), **replaced}.items()
                if key in TrainConfig.field_names() and key not in ("recipe", "model")}
    return TrainConfig.from_recipe(args.recipe, model=model_overrides(args), **settings)
