"""The optimizers of the training recipes: AdamW or SGD with momentum on a linear warm-up
and cosine decay, weight decay on the kernels only, global-norm clipping; and the loss
and metric a classifier compiles with."""

import keras


def decayed_variables(model):
    """The variables AdamW decays: kernels only, as big_vision's `.*/kernel$`."""
    return [v for v in model.trainable_variables if v.name == "kernel"]


def check_warmup(warmup_steps, total_steps):
    if warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps} leaves no steps to decay over: the run has "
            f"{total_steps} steps. Pass --warmup-steps {total_steps // 10} (a tenth of the "
            f"run; any below {total_steps} works), or train longer.")


def make_optimizer(config, total_steps, model):
    """The optimizer a `TrainConfig` names (`adamw` or `sgd_momentum`) with its settings."""
    common = dict(warmup_steps=config.warmup_steps, weight_decay=config.weight_decay,
                  min_learning_rate=config.min_learning_rate, grad_clip=config.grad_clip)
    if config.optimizer == "sgd":
        return sgd_momentum(model, total_steps, config.learning_rate, **common,
                            momentum=0.9 if config.momentum is None else config.momentum)
    return adamw(model, total_steps, config.learning_rate, **common,
                 beta_1=config.beta_1, beta_2=config.beta_2)


def warmup_cosine(learning_rate, total_steps, warmup_steps=0, min_learning_rate=0.0):
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to `min_learning_rate`."""
    check_warmup(warmup_steps, total_steps)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup_steps else learning_rate,
        decay_steps=total_steps - warmup_steps,
        alpha=min_learning_rate / learning_rate,
        warmup_target=learning_rate if warmup_steps else None,
        warmup_steps=warmup_steps)


def adamw(model, total_steps, learning_rate, warmup_steps=0, weight_decay=0.0,
          min_learning_rate=0.0, beta_1=0.9, beta_2=0.999, grad_clip=0.0):
    """AdamW on `warmup_cosine`, kernel-only weight decay, global-norm clipping."""
    optimizer = keras.optimizers.AdamW(
        learning_rate=warmup_cosine(learning_rate, total_steps, warmup_steps, min_learning_rate),
        weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
        global_clipnorm=grad_clip or None)
    return _decay_kernels_only(optimizer, model)


def sgd_momentum(model, total_steps, learning_rate, warmup_steps=0, momentum=0.9,
                 weight_decay=0.0, min_learning_rate=0.0, grad_clip=0.0):
    """SGD with momentum on `warmup_cosine` (big_vision's fine-tuning optimizer), clipping."""
    optimizer = keras.optimizers.SGD(
        learning_rate=warmup_cosine(learning_rate, total_steps, warmup_steps, min_learning_rate),
        momentum=momentum, weight_decay=weight_decay or None,
        global_clipnorm=grad_clip or None)
    return _decay_kernels_only(optimizer, model) if weight_decay else optimizer


def _decay_kernels_only(optimizer, model):
    decayed = {id(v) for v in decayed_variables(model)}
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if id(v) not in decayed])
    return optimizer


def compile_classifier(model, optimizer, label_smoothing):
    """Compiles `model` with cross-entropy on its logits and a weighted accuracy (the
    blank examples of a padded split weigh 0)."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                  label_smoothing=label_smoothing),
        weighted_metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")])
