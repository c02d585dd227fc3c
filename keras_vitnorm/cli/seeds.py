"""One run per seed, for the commands that train several (`segment`, `lit`)."""

import os


def run_seeds(args, run, score, describe):
    """Runs `run(seed, run_dir)` per seed in `<output_dir>/seed_<n>/` (a finished one read back
    unless `args.overwrite`); prints `describe(metrics)` and the mean `metrics[score]`, 95% CI.
    """
    from keras_vitnorm import durable
    from keras_vitnorm.study.stats import confidence_interval

    scores = []
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
    if len(scores) > 1:
        mean, half_width = confidence_interval(scores)
        print(f"{score} over {len(scores)} seeds: {mean:.4f} +- {half_width:.4f} (95% CI)")
