"""A failed `fit`, `evaluate` or `predict` leaves the model as it was (Keras' JAX trainer
empties the variables while it runs), a stop signal is acted on wherever it lands (a
garbage-collection callback drops what its handler raises), and LiT refuses captions
cut before their class word."""

import contextlib
import gc
import os
import re
import signal
import sys
import time

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import backend
from keras_vitnorm.models.contrastive import LiT
from keras_vitnorm.models.contrastive import caption_vocabulary
from keras_vitnorm.models.segmenter import Segmenter
from test_durability import signals_raise  # noqa: F401 (a fixture)

# ----------------------------------------------------------------------------- a failed call

GRAY = dict(image_size=16, patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64,
            num_channels=1, num_classes=3)
IMAGES = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 1)).astype("float32")
LABELS = np.array([0, 1, 2, 0])
RGB = np.zeros((4, 16, 16, 3), "float32")

CALLS = {
    "fit": lambda model, x, y: model.fit(x, y, batch_size=4, verbose=0),
    "evaluate": lambda model, x, y: model.evaluate(x, y, verbose=0),
    "predict": lambda model, x, y: model.predict(x, verbose=0),
    "train_on_batch": lambda model, x, y: model.train_on_batch(x, y),
    "test_on_batch": lambda model, x, y: model.test_on_batch(x, y),
    "predict_on_batch": lambda model, x, y: model.predict_on_batch(x),
}


def gray_vit(trained=True):
    keras.utils.set_random_seed(0)
    model = ViT(**GRAY)
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if trained:  # a trained model: its head is no longer zero, its optimizer has state
        model.fit(IMAGES, LABELS, batch_size=4, epochs=2, verbose=0)
    return model


def assert_intact(model, expected, tmp_path):
    """`model` predicts `expected` exactly, and so do its saved file and preset."""
    np.testing.assert_array_equal(model.predict(IMAGES, verbose=0), expected)
    # A direct call runs op by op: the compiled prediction's values up to round-off.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(IMAGES)), expected, atol=1e-5)
    model.save(tmp_path / "model.keras")
    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(reloaded.predict(IMAGES, verbose=0), expected)
    model.save_to_preset(tmp_path / "preset")
    np.testing.assert_array_equal(
        ViT.from_preset(str(tmp_path / "preset")).predict(IMAGES, verbose=0), expected)


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_with_images_of_the_wrong_shape_is_refused_and_keeps_the_model(call, tmp_path):
    """The 1-channel model given 3-channel images: a clear error before Keras' trainer
    runs (whose failing step, under JAX, would leave the model's variables empty)."""
    model = gray_vit()
    before = model.predict(IMAGES, verbose=0)
    with pytest.raises(ValueError) as refused:
        CALLS[call](model, RGB, LABELS)
    assert str(refused.value) == (
        f"ViT.{call} got images of shape (4, 16, 16, 3); the model takes images of shape "
        "(batch, height, width, channels) = (batch, 16, 16, 1), channels last. The model was "
        "built for 1-channel images (num_channels=1); these have 3.")
    assert_intact(model, before, tmp_path)


def test_channels_first_images_are_told_to_transpose_and_validation_data_is_checked_first():
    model = gray_vit(trained=False)
    with pytest.raises(ValueError, match=r"got images of shape \(2, 3, 16, 16\).* These look "
                       r"channels-first .*np\.transpose\(images, \(0, 2, 3, 1\)\)"):
        ViT(**{**GRAY, "num_channels": 3}).predict(np.zeros((2, 3, 16, 16), "float32"), verbose=0)
    with pytest.raises(ValueError, match=r"ViT\.fit got images of shape \(4, 16, 16, 3\)"):
        model.fit(IMAGES, LABELS, validation_data=(RGB, LABELS), verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0  # refused first


@pytest.mark.parametrize("call", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_labels_the_loss_does_not_take_keep_the_model(call, tmp_path):
    """A failure inside the compiled step, which no check before it sees."""
    model = gray_vit()
    before = model.predict(IMAGES, verbose=0)
    with pytest.raises(ValueError, match="target.shape="):
        CALLS[call](model, IMAGES, np.zeros((4, 5), "float32"))
    assert_intact(model, before, tmp_path)


def one_step(generator=False):
    """The predictions of a fresh `gray_vit` after one step on `IMAGES` (fed by a
    generator, or as arrays)."""
    model = gray_vit(trained=False)
    if generator:
        model.fit(batches(IMAGES), verbose=0)
    else:
        model.fit(IMAGES, LABELS, batch_size=4, verbose=0)
    return model.predict(IMAGES, verbose=0)


def batches(*images):
    for batch in images:
        yield batch, LABELS


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_a_generator_whose_second_batch_fails_keeps_the_model(call, tmp_path):
    """A failure after a finished step, which no check before the call sees: `evaluate`
    and `predict` leave the model as it was, `fit` as its first step left it (TensorFlow's
    input pipeline reads the second batch before the first step runs: as it was)."""
    model = gray_vit(trained=call != "fit")
    before = model.predict(IMAGES, verbose=0)
    with pytest.raises(Exception):  # the layer's ValueError; TensorFlow's own for its dataset
        getattr(model, call)(batches(IMAGES, RGB), verbose=0)
    stepped = call == "fit" and backend.name() != "tensorflow"
    assert_intact(model, one_step(generator=True) if stepped else before, tmp_path)


def test_ctrl_c_while_the_first_step_compiles_keeps_the_model_and_its_new_optimizer(tmp_path):
    """The optimizer's variables, made by this first `fit`, get their values back too."""
    model = gray_vit(trained=False)
    before = model.predict(IMAGES, verbose=0)

    def interrupted(*args):
        raise KeyboardInterrupt

    model.train_step = interrupted
    with pytest.raises(KeyboardInterrupt):
        model.fit(IMAGES, LABELS, batch_size=4, verbose=0)
    del model.train_step
    model.make_train_function(force=True)  # the step function made with the interrupting step
    assert_intact(model, before, tmp_path)
    model.fit(IMAGES, LABELS, batch_size=4, verbose=0)  # trains on as a fresh model does
    np.testing.assert_allclose(model.predict(IMAGES, verbose=0), one_step(), atol=1e-6)


@pytest.mark.skipif(backend.name() != "jax", reason="only Keras' JAX trainer empties the variables")
def test_without_keras_jax_state_the_values_before_the_call_come_back(monkeypatch, tmp_path):
    """The fallback where Keras keeps no `_jax_state`: the values the variables had when
    the call began; variables whose values a finished step consumed are named."""
    from keras_vitnorm.backend import _jax

    monkeypatch.setattr(_jax, "_STATE", "_no_state_here")
    model = gray_vit()
    before = model.predict(IMAGES, verbose=0)
    with pytest.raises(ValueError, match="target.shape"):
        model.fit(IMAGES, np.zeros((4, 5), "float32"), verbose=0)
    assert_intact(model, before, tmp_path)
    with pytest.raises(ValueError) as failed:  # the first batch's step consumed the values
        model.predict(batches(IMAGES, RGB), verbose=0)
    assert re.search(r"The failed call left \d+ of the model's variables without a value "
                     r"\(stem/.*\): load its weights again before using it\.",
                     "".join(getattr(failed.value, "__notes__", [])))


@pytest.mark.skipif(backend.name() != "jax", reason="Keras' JAX variables only")
def test_an_emptied_variable_is_told_by_its_value_or_by_the_public_property():
    """`Variable._value` where Keras has it, else `Variable.value`, which fails on an
    emptied variable (it calls the initializer Keras dropped)."""
    from keras_vitnorm.backend import _jax

    variable = keras.Variable(np.ones(2, "float32"))
    assert not _jax._emptied(variable)
    variable._value = None
    assert _jax._emptied(variable)

    class WithoutPrivateValue:
        def __init__(self, value):
            self._held = value

        @property
        def value(self):
            if self._held is None:
                raise TypeError("'NoneType' object is not callable")
            return self._held

    assert not _jax._emptied(WithoutPrivateValue(np.ones(2)))
    assert _jax._emptied(WithoutPrivateValue(None))


def test_a_segmenter_and_a_lit_check_their_inputs_and_keep_their_weights():
    vit = ViT(**{**GRAY, "num_channels": 3})
    segmenter = Segmenter(vit, num_classes=2)
    images = np.random.default_rng(1).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    before = segmenter.predict(images, verbose=0)
    with pytest.raises(ValueError,
                       match=r"Segmenter\.predict got images of shape \(4, 16, 16, 1\)"):
        segmenter.predict(IMAGES, verbose=0)
    np.testing.assert_array_equal(segmenter.predict(images, verbose=0), before)

    captions = ["a photo of a cat", "a photo of a dog"] * 2
    lit = LiT(vit, caption_vocabulary(captions), max_length=8, embed_dim=16, text_width=32,
              text_depth=1, text_heads=2, text_mlp_dim=64)
    lit.compile(keras.optimizers.Adam(1e-3))
    batch = {"images": images, "tokens": lit.tokenize(captions)}
    lit.fit(batch, batch_size=4, verbose=0)
    before = keras.ops.convert_to_numpy(lit(batch))
    with pytest.raises(ValueError, match=r"LiT\.fit got tokens of shape \(4, 4\); the model "
                       r"takes tokens of shape \(batch, 8\)"):
        lit.fit({"images": images, "tokens": batch["tokens"][:, :4]}, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match=r"LiT\.predict got images of shape \(4, 16, 16, 1\)"):
        lit.predict({"images": IMAGES, "tokens": batch["tokens"]}, verbose=0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(lit(batch)), before)


# ----------------------------------------------------------------------------- a stop signal


@contextlib.contextmanager
def signal_in_gc_callback(number):
    """`number` is sent to this process once, inside a garbage-collection callback of the
    next collection: its handler runs there, and Python drops what the handler raises."""
    sent = []

    def callback(phase, info):
        if phase == "start" and not sent:
            sent.append(number)
            signal.raise_signal(number)  # runs the handler before it returns

    gc.callbacks.append(callback)
    try:
        yield sent
    finally:
        gc.callbacks.remove(callback)


def collect_with_signal(number):
    """A collection whose callback receives `number`."""
    with signal_in_gc_callback(number) as sent:
        gc.collect()
    assert sent == [number]


@pytest.mark.one_backend
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_a_gc_callback_stops_a_run_at_once(signals_raise, number):
    from keras_vitnorm.training.interrupts import RunInterrupted
    from keras_vitnorm.training.interrupts import StopRequest

    hook = sys.unraisablehook
    with StopRequest(say=lambda text: None).listening():
        with pytest.raises(RunInterrupted) as stopped:
            collect_with_signal(number)
            time.sleep(5)  # raised before this
    assert stopped.value.exit_status == 128 + number
    assert sys.unraisablehook is hook  # given back


@pytest.mark.one_backend
def test_a_stop_whose_exception_was_caught_is_acted_on_before_the_training_steps(signals_raise):
    """A safe point: `deferred()`, which `fit` runs in, raises at once for a request made
    before it; the steps' callback ends `fit` before its first step."""
    from keras_vitnorm.training.interrupts import RunInterrupted
    from keras_vitnorm.training.interrupts import StopOnSignal
    from keras_vitnorm.training.interrupts import StopRequest

    request = StopRequest(say=lambda text: None)
    with request.listening():
        try:  # code that catches what the handler raises
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        ran = []
        with pytest.raises(RunInterrupted):
            with request.deferred():
                ran.append("steps")
        assert ran == []
        with pytest.raises(RunInterrupted):
            StopOnSignal(request).on_train_begin()


def sigterm_turned_into(error):
    """Sends this process SIGTERM and raises `error` in place of the stop its handler
    raises, as code that reports an interrupt as a failure of its own does (NumPy's
    import)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first
    except KeyboardInterrupt:
        raise error from None


@pytest.mark.one_backend
def test_a_command_stopped_inside_a_gc_callback_ends_with_its_status(monkeypatch, capsys,
                                                                     signals_raise):
    """Outside a training run (here `evaluate`), the command's SIGTERM too."""
    from keras_vitnorm import cli
    from keras_vitnorm.cli import evaluate as evaluate_command

    def stopped(args):
        collect_with_signal(signal.SIGTERM)
        time.sleep(5)  # raised before this

    monkeypatch.setattr(evaluate_command, "run", stopped)
    assert cli.main(["evaluate", "runs/x"]) == 143
    assert capsys.readouterr().err == (
        "keras-vitnorm evaluate: error: Stopped by SIGTERM. Nothing was written.\n")

    def caught(args):  # a framework's bare `except` around the signal
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass

    monkeypatch.setattr(evaluate_command, "run", caught)
    assert cli.main(["evaluate", "runs/x"]) == 130
    assert capsys.readouterr().err == (
        "keras-vitnorm evaluate: error: SIGINT received while the command ran, where it could "
        "not stop it: the command ran to its end first.\n")

    def changed(args):  # NumPy's import reports a KeyboardInterrupt as its own failure
        sigterm_turned_into(ImportError("Importing the numpy C-extensions failed."))

    monkeypatch.setattr(evaluate_command, "run", changed)
    assert cli.main(["evaluate", "runs/x"]) == 143
    assert capsys.readouterr().err == (
        "keras-vitnorm evaluate: error: Stopped by SIGTERM. (It landed in code that raised "
        "ImportError: Importing the numpy C-extensions failed. instead.) Nothing was "
        "written.\n")


def tiny_run(output_dir):
    from keras_vitnorm.training import TrainConfig

    return TrainConfig.from_recipe(
        "small", model=dict(image_size=16, patch_size=4, width=32, depth=1, num_heads=2,
                            mlp_dim=64),
        steps=4, batch_size=32, warmup_steps=1, tensorboard=False, output_dir=str(output_dir))


@pytest.mark.one_backend
@pytest.mark.parametrize("where", ["gc_callback", "caught", "changed"])
def test_a_signal_while_the_data_loads_stops_the_run_before_any_step(where, tmp_path,
                                                                     monkeypatch, signals_raise):
    """Landing in a garbage-collection callback, the signal stops the run at once; where
    the code it lands in catches its exception, at the run's next safe point: before the
    model is built, with nothing trained. Where that code raises an error of its own
    instead (NumPy's import: "Importing the numpy C-extensions failed"), the error is
    the stop."""
    from keras_vitnorm.training import RunInterrupted
    from keras_vitnorm.training import data as data_lib
    from keras_vitnorm.training import train

    load = data_lib.load_dataset

    def loading(*args, **kwargs):
        data = load(*args, **kwargs)
        if where == "gc_callback":
            collect_with_signal(signal.SIGTERM)
            time.sleep(5)  # the run's code goes on: raised before this ends
        elif where == "changed":
            sigterm_turned_into(ImportError("Importing the numpy C-extensions failed."))
        else:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except KeyboardInterrupt:
                pass
        return data

    monkeypatch.setattr(data_lib, "load_dataset", loading)
    run_dir = tmp_path / "run"
    with pytest.raises(RunInterrupted) as stopped:
        train(tiny_run(run_dir), verbose=0)
    assert stopped.value.exit_status == 143
    if where in ("gc_callback", "changed"):
        assert str(stopped.value) == (
            "Stopped by SIGTERM before the run directory was set up: nothing was written.")
    else:
        assert str(stopped.value) == (
            f"Stopped by SIGTERM before its first checkpoint: resumed, the run in {run_dir} "
            "starts from step 0.")
        assert not list(run_dir.glob("backup/step-*"))  # nothing trained


@pytest.mark.one_backend
def test_a_stop_changed_into_another_error_in_a_claimed_run_directory_keeps_it_to_resume(
        tmp_path, monkeypatch, signals_raise):
    """After the run directory is set up, a stop that the code it landed in turned into an
    error of its own is still a stop: the directory is not removed as a failed start, and
    the message says how to resume it."""
    from keras_vitnorm.training import RunInterrupted
    from keras_vitnorm.training import train
    from keras_vitnorm.training import trainer

    def building(*args, **kwargs):
        sigterm_turned_into(RuntimeError("XLA compilation was cancelled."))

    monkeypatch.setattr(trainer, "Run", building)
    run_dir = tmp_path / "run"
    with pytest.raises(RunInterrupted) as stopped:
        train(tiny_run(run_dir), verbose=0)
    assert stopped.value.exit_status == 143 and stopped.value.resumable
    assert str(stopped.value) == (
        f"Stopped by SIGTERM before its first checkpoint: resumed, the run in {run_dir} "
        "starts from step 0.")
    assert (run_dir / "train_config.json").is_file()


SIGTERM_IN_GC_CALLBACK = """
import gc, signal, sys
from keras_vitnorm.cli import console

sent = []

def callback(phase, info):
    # Once the command's handler is installed: at its first collection after that.
    if phase == "start" and not sent and callable(signal.getsignal(signal.SIGTERM)):
        sent.append(True)
        signal.raise_signal(signal.SIGTERM)

gc.callbacks.append(callback)
console({argv!r})
"""


def test_sigterm_during_start_up_inside_a_gc_callback_ends_the_command_with_143(tmp_path):
    """The command itself, in a process of its own: a SIGTERM at its first garbage
    collection after the command's handler is installed (the imports of its start-up)."""
    from test_training import run_python

    run_dir = tmp_path / "run"
    argv = ["train", "--image-size", "16", "--patch-size", "4", "--width", "32", "--depth", "1",
            "--num-heads", "2", "--mlp-dim", "64", "--steps", "4", "--batch-size", "32",
            "--warmup-steps", "1", "--no-tensorboard", "--verbose", "0",
            "--output-dir", str(run_dir)]
    child = run_python(SIGTERM_IN_GC_CALLBACK.format(argv=argv))
    assert child.returncode == 143, child.stderr[-3000:]
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("keras-vitnorm train: error: Stopped by SIGTERM"), child.stderr[-3000:]
    assert last.endswith("Nothing was trained: run the same command again."), last
    assert "Exception ignored" not in child.stderr
    assert not (run_dir / "metrics.json").exists()


# ----------------------------------------------------------------------------- LiT captions


LIT_ARGV = ["lit", "--image-size", "16", "--set", "patch_size=4", "--set", "width=32", "--set",
            "depth=1", "--set", "num_heads=4", "--set", "mlp_dim=64", "--embed-dim", "16",
            "--text-width", "32", "--text-depth", "1", "--text-mlp-dim", "64",
            "--train-examples", "100", "--epochs", "1", "--batch-size", "32",
            "--warmup-steps", "0", "--verbose", "0"]


@pytest.mark.one_backend
def test_lit_refuses_a_max_length_that_cuts_the_class_names(tmp_path, capsys):
    """`--max-length 1` kept "a" of every caption: every class's captions alike, zero-shot
    accuracy at chance, exit status 0. Refused before anything is read or written."""
    from keras_vitnorm import cli

    assert cli.main([*LIT_ARGV, "--max-length", "1", "--output-dir", str(tmp_path / "lit")]) == 2
    assert capsys.readouterr().err == (
        "keras-vitnorm lit: error: max_length=1 cuts the class names out of the captions: "
        "'a low resolution photo of the {}.' puts the class name at token 7 (further with a "
        "name of several words). Use a max_length of at least 7.\n")
    assert not (tmp_path / "lit").exists()


@pytest.mark.one_backend
def test_lit_training_and_zero_shot_prompts_refuse_a_length_that_cuts_a_long_class_name(
        monkeypatch):
    from keras_vitnorm.training import contrastive as contrastive_training

    names = [*contrastive_training.DIGIT_NAMES[:9], "golf ball"]  # digits' tenth class renamed
    monkeypatch.setattr(contrastive_training, "class_names_for", lambda data: names)
    config = contrastive_training.LiTConfig(
        image_size=16, model=dict(patch_size=4, width=32, depth=1, num_heads=4, mlp_dim=64),
        embed_dim=16, max_length=7, text_width=32, text_depth=1, text_mlp_dim=64,
        train_examples=40, epochs=1, batch_size=4, warmup_steps=0)
    with pytest.raises(ValueError, match=re.escape(
            "max_length=7 cuts the class names out of the captions: 'a low resolution photo of "
            "the golf ball.' ends its class name at token 8. Use a max_length of at least 8.")):
        contrastive_training.train_lit(config, verbose=0)

    model = LiT(ViT(**{**GRAY, "num_channels": 3}), caption_vocabulary(["a photo of a cat"]),
                max_length=4, embed_dim=16, text_width=32, text_depth=1, text_heads=2,
                text_mlp_dim=64)
    with pytest.raises(ValueError, match=re.escape(
            "max_length=4 cuts the class names out of the captions: 'a photo of a cat' ends its "
            "class name at token 5. Use a max_length of at least 5.")):
        model.zero_shot_classifier(["cat"], ["a photo of a {}"])
    assert model.zero_shot_classifier(["cat"], ["the {} in a photo"]).shape == (1, 16)
