"""`--track mlflow`: a run's settings, per-epoch and final metrics in MLflow
(docs/your-norm.md, "Tracking in MLflow"). `MlflowClient` takes run ids explicitly: a
study's runs never share MLflow's global active run.
"""

import json
import math
import os
import time

import keras

from keras_vitnorm import durable
from keras_vitnorm.training.run_layout import read_log

#: The file in a run (or study) directory that names its MLflow run.
RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "keras-vitnorm"
#: MLflow's limit on a parameter value's length.
_MAX_PARAM = 500


def _client():
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ValueError(
            "--track mlflow needs MLflow: pip install 'keras-vitnorm[track]'.") from None
    return MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default


def _experiment_id(client):
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def _flat_params(settings, prefix=""):
    """`{name: text}` of a nested settings dict, `model.norm` for a nested key."""
    params = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            params.update(_flat_params(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[f"{prefix}{key}"] = text[:_MAX_PARAM]
    return params


def study_outputs(study_dir):
    """The tables and figures of a study directory: what its MLflow run keeps."""
    folders = (study_dir, os.path.join(study_dir, "figures"))
    return [os.path.join(folder, name) for folder in folders if os.path.isdir(folder)
            for name in sorted(os.listdir(folder)) if name.endswith((".md", ".csv", ".png"))]


class TrackedRun:
    """The MLflow run of a run (or study) `directory`, created with `params` on first use;
    `parent_run_id` is the study's MLflow run, for a run of a study."""

    def __init__(self, directory, name, params=None, parent_run_id=None):
        self.directory = directory
        self.client = _client()
        self.path = os.path.join(directory, RUN_FILE)
        self.state = durable.read_json(self.path) or {}
        if not self._exists(self.state.get("run_id")):
            self._create(name, params or {}, parent_run_id)

    def _exists(self, run_id):
        if not run_id:
            return False
        try:
            self.client.get_run(run_id)
            return True
        except Exception:  # deleted on the server, or another tracking URI: a new run
            return False

    def _create(self, name, params, parent_run_id):
        from mlflow.entities import Param

        tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
        run = self.client.create_run(_experiment_id(self.client), run_name=name, tags=tags)
        params = [Param(key, value) for key, value in _flat_params(params).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(run.info.run_id, params=params[start:start + 100])
        self.state = {"run_id": run.info.run_id, "epochs_logged": 0}
        durable.write_json(self.path, self.state)

    @property
    def run_id(self):
        return self.state["run_id"]

    def log_metrics(self, values, step):
        """Logs the finite numbers of `values` at `step`."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_epoch(self, epoch, logs):
        """Logs epoch `epoch`'s metrics (1-based) unless it was logged before a resume."""
        if epoch <= self.state.get("epochs_logged", 0):
            return
        self.log_metrics(logs or {}, step=epoch)
        self.state = {**self.state, "epochs_logged": epoch}
        durable.write_json(self.path, self.state)

    def finish(self, metrics, status="FINISHED"):
        self.log_metrics({f"final_{key}": value for key, value in metrics.items()},
                         step=self.state.get("epochs_logged", 0))
        self.client.set_terminated(self.run_id, status)

    def log_artifacts(self, paths):
        for path in paths:
            if os.path.exists(path):
                self.client.log_artifact(self.run_id, path)

    def log_earlier_epochs(self):
        """Logs the epochs of `log.csv` that a killed process did not log."""
        for row in read_log(os.path.join(self.directory, "log.csv")):
            self.log_epoch(row.pop("epoch") + 1, row)

    def callback(self):
        """A Keras callback that logs each epoch's metrics (a resumed run's earlier first)."""
        return keras.callbacks.LambdaCallback(
            on_train_begin=lambda logs: self.log_earlier_epochs(),
            on_epoch_end=lambda epoch, logs: self.log_epoch(epoch + 1, logs))
