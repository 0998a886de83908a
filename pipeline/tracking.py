"""MLflow plumbing shared by training (`pipeline.train.logger`), evaluation (`evaluation.report`) and
`tlf compare`: one default store, one way to open a client and an experiment, one batched metric writer."""
from __future__ import annotations

from pathlib import Path

BATCH = 1000  # MLflow's log_batch limit on metrics per call


def tracking_uri(uri: str = "") -> str:
    """The given URI, else the local default that needs no server: sqlite:///<cwd>/mlflow.db."""
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def client(uri: str = ""):
    """An MlflowClient on tracking_uri(uri), with the database-migration chatter silenced."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=tracking_uri(uri))


def experiment_id(cl, name: str) -> str:
    """The id of experiment `name`, created if it does not exist."""
    exp = cl.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else cl.create_experiment(name)


def log_metrics(cl, run_id: str, metrics: list) -> None:
    """Sends mlflow.entities.Metric objects with log_batch, BATCH at a time."""
    for i in range(0, len(metrics), BATCH):
        cl.log_batch(run_id, metrics=metrics[i:i + BATCH])
