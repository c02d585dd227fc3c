"""`--track mlflow`: runs read back through MLflow's own client. A run's settings are its
parameters, each epoch's metrics a history, its final metrics and status at the end; a
run killed and resumed continues the same MLflow run; a study is the parent of its runs,
with its tables as artifacts."""

import json

import pytest
from mlflow.tracking import MlflowClient

from keras_vitnorm import cli
from keras_vitnorm.training import TrainConfig
from keras_vitnorm.training import train
from keras_vitnorm.training.tracking import RUN_FILE
from test_training import TINY


class Killed(BaseException):
    """A process killed at this point: nothing after it runs."""


def _client(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    # The experiment the runs go to, its artifacts in the test's folder (not ./mlruns).
    client.create_experiment("keras-vitnorm", artifact_location=(tmp_path / "artifacts").as_uri())
    return client


def _history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                               key=lambda m: m.step)]


# MLflow's records of a run, written from Keras' callbacks: no backend enters them.
@pytest.mark.one_backend
def test_a_run_killed_and_resumed_is_one_mlflow_run_with_every_epoch_once(tmp_path, monkeypatch):
    client = _client(tmp_path, monkeypatch)
    out = tmp_path / "run"
    config = TrainConfig.from_recipe("small", model=TINY, steps=6, steps_per_epoch=2,
                                     batch_size=32, warmup_steps=1, tensorboard=False,
                                     output_dir=str(out))

    class KillAfterSecondEpoch:
        def __init__(self):
            import keras

            self.callback = keras.callbacks.LambdaCallback(on_epoch_end=self.end)

        def end(self, epoch, logs):
            if epoch == 1:
                raise Killed

    with pytest.raises(Killed):
        train(config, verbose=0, track={}, callbacks=[KillAfterSecondEpoch().callback])
    run_id = json.loads((out / RUN_FILE).read_text())["run_id"]
    assert client.get_run(run_id).info.status == "RUNNING"
    metrics = train(config, resume=True, verbose=0, track={})
    runs = client.search_runs([client.get_experiment_by_name("keras-vitnorm").experiment_id])
    assert [run.info.run_id for run in runs] == [run_id]  # continued, not a second run
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.width"] == str(TINY["width"])
    assert run.data.params["steps"] == "6" and run.data.params["preset"] == "ti16"
    history = _history(client, run_id, "val_accuracy")
    assert [step for step, _ in history] == [1, 2, 3]  # each epoch once, the resumed ones too
    log = (out / "log.csv").read_text().splitlines()
    columns = log[0].split(",")
    last = dict(zip(columns, log[-1].split(",")))
    assert history[-1][1] == pytest.approx(float(last["val_accuracy"]))
    assert run.data.metrics["final_test_accuracy"] == pytest.approx(metrics["test_accuracy"])


# MLflow's records of a study, written from Keras' callbacks: no backend enters them.
@pytest.mark.one_backend
def test_a_study_is_the_parent_of_its_runs_with_its_tables(tmp_path, monkeypatch):
    client = _client(tmp_path, monkeypatch)
    study = tmp_path / "s"
    status = cli.main(["ablate", "--groups", "stems", "--variants", "stems:dual_patchnorm",
                       "--seeds", "0", "--output-dir", str(study), "--track", "mlflow",
                       "--image-size", "16", "--patch-size", "4", "--width", "32", "--depth",
                       "1", "--num-heads", "2", "--mlp-dim", "64", "--steps", "4",
                       "--batch-size", "32", "--warmup-steps", "1", "--grad-norm-every", "2",
                       "--verbose", "0"])
    assert status == 0
    parent_id = json.loads((study / RUN_FILE).read_text())["run_id"]
    experiment = client.get_experiment_by_name("keras-vitnorm").experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(run.info.run_name for run in children) == [
        "stems-dual_patchnorm-seed_0", "stems-patch-seed_0"]
    for run in children:
        assert run.info.status == "FINISHED" and "final_test_accuracy" in run.data.metrics
    artifacts = [item.path for item in client.list_artifacts(parent_id)]
    assert "stems.md" in artifacts and "results.csv" in artifacts
