"""One run per seed, for the commands that train several (`segment`, `lit`)."""

import dataclasses
import os


def config_from_args(kind, args, **values):
    """The `kind` dataclass of the parsed options named as its fields, then `values`."""
    given = {field.name: getattr(args, field.name) for field in dataclasses.fields(kind)
             if hasattr(args, field.name)}
    return kind(**{**given, **values})


def run_seeds(args, train, config, score, describe, **options):
    """Trains `config` once per seed in `<output_dir>/seed_<n>/` (a finished run read back unless
    `args.overwrite`); prints `describe(metrics)` per seed and the mean `metrics[score]`, 95% CI."""
    from keras_vitnorm import durable
    from keras_vitnorm.study.stats import confidence_interval
    from keras_vitnorm.training.run_layout import METRICS_FILE

    scores = []
    for seed in args.seeds:
        run_dir = os.path.join(args.output_dir, f"seed_{seed}")
        metrics = durable.read_json(os.path.join(run_dir, METRICS_FILE))
        if metrics and not args.overwrite:
            if args.verbose:
                print(f"seed {seed}: finished earlier in {run_dir}")
        else:
            metrics = train(dataclasses.replace(config, seed=seed), run_dir,
                            overwrite=args.overwrite, verbose=args.verbose,
                            take_over_lock=args.take_over_lock, **options)
        scores.append(metrics[score])
        print(f"seed {seed}: {describe(metrics)}")
    if len(scores) > 1:
        mean, half_width = confidence_interval(scores)
        print(f"{score} over {len(scores)} seeds: {mean:.4f} +- {half_width:.4f} (95% CI)")
