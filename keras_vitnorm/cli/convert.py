"""`keras-vitnorm convert`: a standard checkpoint written as a preset; the zoo alone runs it."""

from keras_vitnorm.choices import RESAMPLE_METHODS
from keras_vitnorm.cli.arguments import add_model_overrides
from keras_vitnorm.cli.arguments import model_overrides
from keras_vitnorm.cli.arguments import one_of

NAME = "convert"
EXTRA = None
INTERRUPTED = "The destination is written whole or not at all."
HELP = "convert a standard ViT checkpoint into a keras_vitnorm preset directory"
DESCRIPTION = ("Read a Hugging Face model directory, a keras-hub ViT preset, a timm or "
               "Hugging Face .safetensors/.pth file or a big_vision/AugReg .npz, and write it as a "
               "keras_vitnorm preset (ViT.from_preset(DST)). Overrides change the image size "
               "(position embedding resampled), the classes (new head) or the normalization "
               "(fine-tuning a plain checkpoint into a variant); the report lists every new and "
               "dropped weight.")

EXAMPLES = """examples:
  keras-vitnorm convert ~/hf/vit-base-patch16-224 presets/b16_hf
  keras-vitnorm convert ViT-B_16.npz presets/b16_augreg_384 --image-size 384
  keras-vitnorm convert vit_small_patch16_224.safetensors presets/s16_dpn_ft \\
      --stem dual_patchnorm --num-classes 10

Load the result with keras_vitnorm.ViT.from_preset(DESTINATION); see docs/checkpoints.md.
"""


def add_arguments(parser):
    parser.add_argument("source", help="checkpoint file or directory")
    parser.add_argument("destination", help="preset directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a preset already in DESTINATION")
    parser.add_argument("--verbose", type=int, choices=(1, 2), default=1,
                        help="1 the conversion report (default), 2 also the frameworks' log lines")
    parser.add_argument("--num-classes", dest="model_num_classes", type=int,
                        help="classes of a new head (0 = features only)")
    parser.add_argument("--resample", **one_of(RESAMPLE_METHODS), default="bilinear",
                        help="how --image-size resamples the position embedding: bilinear "
                        "(big_vision, default) or bicubic (timm)")
    overrides = parser.add_argument_group("model overrides (normalization and image size)")
    add_model_overrides(overrides, fixed=("width", "depth", "mlp_dim", "patch_size", "pooling"),
                        set_help="any other ViT config value",
                        notes={"num_heads": " (only for state dicts that do not record it)"})


def run(args):
    import os

    from keras_vitnorm.convert import is_checkpoint
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models import load_checkpoint
    from keras_vitnorm.models.preset_io import CONFIG_FILE
    from keras_vitnorm.validation import check_directory_path

    overrides = model_overrides(args)
    num_heads = overrides.pop("num_heads", None)
    check_directory_path(args.destination, "destination preset directory")
    if os.path.exists(os.path.join(args.destination, CONFIG_FILE)) and not args.overwrite:
        raise FileExistsError(f"{args.destination!r} already holds a preset ({CONFIG_FILE}); "
                              "pass --overwrite to replace it.")
    if os.path.isdir(args.source) and not is_checkpoint(args.source):
        # A keras_vitnorm preset: re-saved with the overrides (a new size or head).
        if num_heads is not None:
            raise ValueError(f"--num-heads does not apply: {args.source!r} is a "
                             "keras_vitnorm preset, which records its head count.")
        model, report = ViT.from_preset(args.source, resample=args.resample, **overrides), None
    else:
        model, report = load_checkpoint(args.source, num_heads=num_heads,
                                        resample=args.resample, **overrides)
    model.save_to_preset(args.destination, overwrite=args.overwrite)
    if report is not None:
        print(report)
    print(f"Wrote {args.destination} ({model.count_params():,} parameters); load it with "
          f"ViT.from_preset({args.destination!r}).")
