"""`keras-vitnorm ablate`: the normalization study, `keras_vitnorm.study.run_study`."""

from keras_vitnorm.choices import VARIANT_GROUP_NAMES
from keras_vitnorm.cli.arguments import PER_RUN_LEVELS
from keras_vitnorm.cli.arguments import TAKE_OVER_LOCK_HELP
from keras_vitnorm.cli.arguments import add_training_arguments
from keras_vitnorm.cli.arguments import add_verbose
from keras_vitnorm.cli.arguments import one_of
from keras_vitnorm.cli.arguments import train_config_from_args

NAME = "ablate"
EXTRA = "study"
INTERRUPTED = "Rerun the same command to continue."
HELP = "run the normalization study: variant groups x seeds, tables and figures"
DESCRIPTION = ("Train every variant of the chosen groups with every seed on top of "
               "a base recipe, then write results.csv, a markdown table per group and figures. "
               "Rerunning the same command skips finished runs and resumes interrupted ones.")

EXAMPLES = """examples:
  keras-vitnorm ablate --groups placements stems --seeds 0 1 2 --output-dir studies/digits
  keras-vitnorm ablate --groups stems --variants stems:dual_patchnorm stems:conv \\
      --dataset folder:/data/cifar10 --epochs 30 --output-dir studies/cifar

  keras-vitnorm ablate --groups converged --lr-sweep 5e-4 1e-3 2e-3 --seeds 0 1 2 \\
      --dataset folder:/data/cifar10 --epochs 30 --output-dir studies/cifar-lr
  keras-vitnorm ablate --groups stems --output-dir studies/digits --plan
      # one command per run in studies/digits/plan/commands.txt, for a scheduler

The base is the small recipe with the plain ti16 preset unless --preset/--recipe say
otherwise; every training option of `train` applies to every run. See docs/study.md.
"""


def add_arguments(parser):
    study = parser.add_argument_group("study")
    study.add_argument("--groups", nargs="+", default=[], **one_of(VARIANT_GROUP_NAMES),
                       help="variant groups to run")
    study.add_argument("--variants-file", metavar="TOML",
                       help="a group of your own variants, each a set of model and training "
                       "overrides (docs/your-norm.md); runs with --groups or alone")
    study.add_argument("--variants", nargs="+", default=[], metavar="GROUP:NAME",
                       help="run only these variants (the group's baseline is always run)")
    study.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    study.add_argument("--output-dir", dest="study_dir", required=True, help="study directory")
    add_verbose(study, PER_RUN_LEVELS)
    study.add_argument("--take-over-lock", action="store_true", help=TAKE_OVER_LOCK_HELP)
    study.add_argument("--track", choices=("mlflow",), help="mlflow: the study is an MLflow run "
                       "(its tables and figures its artifacts), each of its runs a child run with "
                       "its settings and metrics (MLFLOW_TRACKING_URI, default ./mlflow.db)")
    study.add_argument("--parallel", type=int, default=1, metavar="N",
                       help="train N runs at once, each in its own process with its output in "
                       "<output-dir>/logs/ (default 1: one after another)")
    study.add_argument("--threads-per-run", type=int, metavar="K", help="compute threads of each "
                       "parallel run (default: the CPU cores shared out over --parallel)")
    study.add_argument("--executor", choices=("local", "ray"), default="local",
                       help="local (default): train here (--parallel runs at once); ray: each "
                       "run a Ray task (a local Ray, or --ray-address), then the tables")
    study.add_argument("--ray-address", metavar="ADDRESS",
                       help="a running Ray cluster (default: start a local Ray); the study "
                       "directory must be on a file system its nodes share")
    study.add_argument("--cpus-per-run", type=float, default=1, metavar="N", help="CPUs each run's "
                       "Ray task asks for, and the run's compute threads (default 1)")
    study.add_argument("--gpus-per-run", type=float, default=0, metavar="N",
                       help="GPUs each run's Ray task asks for (default 0)")
    study.add_argument("--tables-only", action="store_true", help="train nothing: write the tables "
                       "and figures from the runs that have finished, naming the others (a study "
                       "part-way re-tabled, or the runs of a --plan collected)")
    study.add_argument("--plan", action="store_true",
                       help="train nothing: write <output-dir>/plan/commands.txt, one command "
                       "per run that can train now (`keras-vitnorm ablate-job FILE`), for any "
                       "scheduler to run; --tables-only then collects the finished runs")
    study.add_argument("--lr-sweep", nargs="+", type=float, metavar="LR",
                       help="train every variant at each of these peak learning rates first "
                       "(with --sweep-seeds), then compare each at the rate with its best final "
                       "validation accuracy (<group>_lr_selection.md); a variants file's "
                       "variant with its own lr_sweep uses that grid")
    study.add_argument("--extend-sweep", action="store_true",
                       help="a variant whose chosen rate is at an end of the --lr-sweep grid "
                       "also trains the next rate beyond it (the grid's ratio), and again while "
                       "its choice stays there, up to 3 rates beyond either end")
    study.add_argument("--sweep-seeds", nargs="+", type=int, metavar="SEED",
                       help="seeds of the --lr-sweep runs (default: the first of --seeds)")
    add_training_arguments(parser)


def study_config(args):
    """`(base TrainConfig, groups, {group: [variants]}, {(group, variant): rates})` of the parsed
    arguments, a `--variants-file` added as a group."""
    preset = "ti16" if args.preset is None and args.recipe == "small" else args.preset
    config = train_config_from_args(args, preset=preset, output_dir=None)
    if config.grad_norm_every is None:
        config.grad_norm_every = 25
    groups, sweeps = list(args.groups), {}
    if args.variants_file:
        from keras_vitnorm.study.variants import add_variant_group
        from keras_vitnorm.study.variants_file import read_variants_file

        name, file_variants, file_sweeps = read_variants_file(args.variants_file, config)
        add_variant_group(name, file_variants)
        groups.append(name)
        sweeps = {(name, variant): rates for variant, rates in file_sweeps.items()}
    if not groups:
        raise ValueError("ablate needs --groups, --variants-file or both: which variants to train.")
    variants = {}
    for item in args.variants:
        group, _, name = item.partition(":")
        if group not in groups or not name:
            raise ValueError(f"--variants {item!r} must be GROUP:NAME with GROUP one of the "
                             f"study's groups ({', '.join(groups)}).")
        variants.setdefault(group, []).append(name)
    return config, groups, variants, sweeps


def run(args):
    from keras_vitnorm.study import markdown_table
    from keras_vitnorm.study import run_study
    from keras_vitnorm.study import summarize

    if args.tables_only and args.plan:
        raise ValueError("--tables-only and --plan are two ways of training nothing: give one.")
    mode = "tables" if args.tables_only else "plan" if args.plan else "train"
    config, groups, variants, sweeps = study_config(args)
    study = dict(variants=variants, take_over_lock=args.take_over_lock, lr_sweep=args.lr_sweep,
                 sweep_seeds=args.sweep_seeds, extend_sweep=args.extend_sweep,
                 variant_sweeps=sweeps, track=args.track == "mlflow")
    if args.executor == "ray":
        if mode != "train" or args.parallel != 1:
            raise ValueError("--executor ray trains the study's runs as Ray tasks: leave out "
                             "--plan, --tables-only and --parallel.")
        from keras_vitnorm.study.ray_executor import run_plan_on_ray

        run_plan_on_ray(lambda: run_study(config, groups, args.seeds, args.study_dir, verbose=0,
                                          mode="plan", **study),
                        args.study_dir, args.ray_address, args.cpus_per_run, args.gpus_per_run,
                        say=print if args.verbose else (lambda text: None))
        mode = "tables"
    rows = run_study(config, groups, args.seeds, args.study_dir, verbose=args.verbose,
                     parallel=args.parallel, threads_per_run=args.threads_per_run, mode=mode,
                     **study)
    if mode == "plan":
        return  # run_study named the commands it wrote
    for group in groups:
        group_rows = [r for r in rows if r["group"] == group]
        if group_rows:  # with a sweep, a group whose rates are not chosen yet has none
            print(f"\n{group}\n" + markdown_table(summarize(group_rows)))
