"""Tracking that cannot hurt the run, through the real `tlf train`: a real `mlflow server` killed mid-run and
restarted (started with the README's shared-server command, reached with a non-localhost Host header), kills of
the trainer before and after its first checkpoint (one MLflow entry per step, no run left RUNNING), the local
metrics file that `tlf compare --run-dir` reads, and one-line errors for a dead server. Every kill and restart is
triggered by something the programs report (a line, the metrics file, the store), never by elapsed time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.train.ds import free_port
from tests.test_train import TINY, clean_env, make_shards

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUICK = [
    o
    for o in TINY
    if not o.startswith(
        ("logging.mlflow", "schedule.max_steps", "train.log_interval", "train.eval_interval", "checkpoint.interval")
    )
]
QUICK += ["train.log_interval=1", "train.eval_interval=0", "logging.experiment=t"]


def wait_for(cond, what: str, proc: subprocess.Popen | None = None, limit: float = 300.0, log=None, every=0.05):
    """Polls cond() every `every` s until it is truthy; fails if `proc` ends first (the safety limit only guards a
    hang). `log`: what the failure shows (the tail of a Proc's output)."""
    end = time.monotonic() + limit
    tail = lambda: "\n" + log()[-4000:] if log is not None else ""
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended (exit {proc.returncode}) while waiting for {what}{tail()}")
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what} after {limit:.0f} s{tail()}")


class Proc:
    """A child in its own process group whose stdout and stderr are collected by threads as they come."""

    def __init__(self, cmd, **kw) -> None:
        self.p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
        )
        self.out, self.err = [], []
        self.readers = [
            threading.Thread(target=lambda s=src, d=dst: d.extend(iter(s.readline, "")), daemon=True)
            for src, dst in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for t in self.readers:
            t.start()

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=60)

    def finish(self) -> str:
        self.p.wait(timeout=600)
        for t in self.readers:  # the pipes' end: every line the process wrote has been read
            t.join(timeout=60)
        assert self.p.returncode == 0, self.text()[-3000:]
        return self.text()


def train(tmp: Path, data: Path, uri: str, *extra: str) -> Proc:
    return Proc(
        [
            str(BIN / "tlf"),
            "train",
            "tiny/t-loopformer",
            *QUICK,
            f"data.dir={data}",
            f"checkpoint.dir={tmp / 'ck'}",
            f"logging.tracking_uri={uri}",
            *extra,
        ],
        cwd=tmp,
        env=clean_env(),
    )


def steps_in(path: Path) -> list[int]:
    from pipeline.tracking import read_metrics

    return [r["step"] for r in read_metrics(path)]


def loss_steps(client, run_id: str, polling: bool = False) -> list[int]:
    """The steps of the run's loss on the server; polling: a request the loaded server did not answer in the
    client's time is "none yet" (the next poll asks again)."""
    try:
        return sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    except Exception:  # only while polling; a final check lets it raise
        if not polling:
            raise
        return []


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("data"), 64)


@pytest.mark.slow
def test_kills_leave_one_value_per_step_and_no_run_running(tmp_path, data):
    """Kill 1 before the first checkpoint, kill 2 after one (with steps past it already in MLflow), then a
    rerun to the end: the first run ends KILLED, the resumed run holds every step's loss once, and twice the steps
    that the rerun redid after the checkpoint (the newer value is the run's: the metrics file's). The killed runs
    have a schedule they cannot finish; the rerun's end is set from where the kill landed."""
    from pipeline.tracking import client, metric_history, read_metrics

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    endless = "schedule.max_steps=100000"
    metrics, record = tmp_path / "ck" / "metrics.jsonl", tmp_path / "ck" / "tracking.json"
    a = train(tmp_path, data, uri, endless, "checkpoint.interval=0")
    wait_for(lambda: len(steps_in(metrics)) >= 2 and record.exists(), "run A", a.p)
    first = json.loads(record.read_text())["run_id"]
    a.kill()
    cl = client(uri)
    assert cl.get_run(first).info.status == "RUNNING"  # what a dead process leaves

    b = train(tmp_path, data, uri, endless, "checkpoint.interval=5")
    wait_for(lambda: record.exists() and json.loads(record.read_text())["run_id"] != first, "run B", b.p)
    second = json.loads(record.read_text())["run_id"]
    wait_for(lambda: len(loss_steps(cl, second)) >= 7, "7 steps in MLflow", b.p)  # past the step-5 checkpoint
    b.kill()
    assert cl.get_run(first).info.status == "KILLED"
    sent = loss_steps(cl, second)
    assert sent == list(range(1, len(sent) + 1)) and sent[-1] > 5

    n = sent[-1] + 3  # the rerun passes every step the killed process had sent
    out = train(tmp_path, data, uri, f"schedule.max_steps={n}", "checkpoint.interval=5").finish()
    start = int(re.search(r"resumed from .*global_step(\d+)", out).group(1))
    redone = list(range(start + 1, sent[-1] + 1))
    assert sorted(loss_steps(cl, second)) == sorted(list(range(1, n + 1)) + redone)
    assert metric_history(cl, second, "loss") == [(r["step"], r["loss"]) for r in read_metrics(metrics)]
    assert (f"steps {start + 1}-{sent[-1]} redone" in out) == bool(redone), out[-3000:]
    assert cl.get_run(second).info.status == "FINISHED"
    assert steps_in(metrics) == list(range(1, n + 1))


def readme_server_command() -> str:
    cmds = [
        ln
        for ln in (REPO / "README.md").read_text().splitlines()
        if "mlflow server " in ln and "--allowed-hosts" in ln and not ln.startswith("#")
    ]
    assert len(cmds) == 1, cmds
    return cmds[0].split("  #")[0].strip()


def start_server(tmp: Path, port: int) -> Proc:
    """The README's shared-server command, on this test's store and port."""
    cmd = readme_server_command().replace("sqlite:///mlflow.db", f"sqlite:///{tmp / 'server.db'}")
    cmd = cmd.replace("--port 5000", f"--port {port}") + ("" if "--workers" in cmd else " --workers 1")
    assert f"--port {port}" in cmd  # (one worker: a 2-core test machine)
    # (env: the line may start with VAR=value assignments, which exec cannot take)
    s = Proc(["bash", "-c", f"exec env {cmd}"], cwd=tmp, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    # ready when its store answers, not only /health: a worker's first store request (the store built, the
    # database checked) can outlast the client's timeout on a loaded machine
    wait_for(lambda: _get(search_url(port)) == 200, "the MLflow server", s.p, log=s.text)
    return s


class Server:
    """One real MLflow server for this file's tests (each in its own experiment): started once; the outage test
    kills it and starts it again on the same port and store, and `up()` starts it again if a failed test left it
    down, so no test depends on another's success."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port = tmp, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = start_server(tmp, self.port)

    def up(self) -> "Server":
        if self.proc.p.poll() is not None:
            self.proc = start_server(self.tmp, self.port)
        return self

    def kill(self) -> None:
        self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("mlflow_server"))
    yield s
    s.kill()


def search_url(port: int) -> str:
    """A request the server answers from its store (an experiment search), not only from the web layer."""
    return f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1"


def _get(url: str, host: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@pytest.mark.slow
def test_server_outage_neither_stops_training_nor_loses_a_step(tmp_path, data, server):
    from pipeline.tracking import client

    port, uri, t = server.up().port, server.uri, None
    try:
        # the shared-server recipe answers a client that names this machine (not localhost) in its Host header
        name = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
        assert name and name not in ("localhost", "127.0.0.1")
        api = search_url(port)
        assert _get(api, host=f"{name}:{port}") == 200 and _get(api, host=f"elsewhere:{port}") == 403

        metrics = tmp_path / "ck" / "metrics.jsonl"
        t = train(
            tmp_path, data, uri, "schedule.max_steps=100000", "checkpoint.interval=0", "logging.experiment=outage"
        )
        run_id = wait_for(lambda: re.search(r"MLflow run (\w+)", t.text()), "the run", t.p).group(1)
        cl = client(uri)
        # polled once a second: the server has one worker, which the sender's batches also need
        wait_for(lambda: len(loss_steps(cl, run_id, polling=True)) >= 3, "3 steps on the server", t.p, every=1.0)
        server.kill()
        at_kill = len(steps_in(metrics))
        wait_for(lambda: "MLflow unreachable" in t.text(), "the outage warning", t.p)
        # training goes on while the server is down: more steps reach the local file
        wait_for(lambda: len(steps_in(metrics)) >= at_kill + 10, "10 steps during the outage", t.p)
        # the trainer is paused while the server starts again (tens of seconds on a loaded machine), so the backlog
        # it replays is the outage's steps so far, not as many as the machine's speed makes during a server start
        os.killpg(t.p.pid, signal.SIGSTOP)
        try:
            server.up()  # the same port and store
        finally:
            os.killpg(t.p.pid, signal.SIGCONT)
        wait_for(lambda: "MLflow is back" in t.text(), "the replay", t.p, log=t.text)
        back = len(steps_in(metrics))
        wait_for(lambda: len(steps_in(metrics)) >= back + 3, "3 steps after the replay", t.p)
        os.killpg(t.p.pid, signal.SIGTERM)  # a clean stop: the current step ends, a checkpoint, exit 0
        out = t.finish()
        assert "Traceback" not in out, out[-3000:]
        steps = steps_in(metrics)
        assert steps == list(range(1, len(steps) + 1))
        assert loss_steps(cl, run_id) == steps, out[-3000:] + "\nSERVER:\n" + server.proc.text()[-3000:]
        assert cl.get_run(run_id).info.status == "KILLED", out[-3000:]
    finally:
        if t is not None:
            t.kill()


def tlf_in_process(*args: str, **env: str):
    """`tlf ARGS` through its click entry point in this process, with env set for the call (click's CliRunner)."""
    from click.testing import CliRunner

    from pipeline.cli import main

    return CliRunner().invoke(main, list(args), env=env)


def test_dead_server_is_one_line_and_compare_reads_the_metrics_file(tmp_path, data, monkeypatch):
    from pipeline.config import load_config
    from pipeline.train.trainer import run

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.chdir(tmp_path)
    r = tlf_in_process("compare", "--tracking-uri", dead, "--out", str(tmp_path / "c"))
    assert r.exit_code != 0 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert dead in r.stderr and "Traceback" not in r.output
    # the same from the environment variable, which a run with no tracking_uri honours too
    r = tlf_in_process("compare", "--out", str(tmp_path / "c"), MLFLOW_TRACKING_URI=dead)
    assert r.exit_code != 0 and dead in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output

    # logging.mlflow=false: the metrics file alone, and tlf compare reads it
    over = [f"data.dir={data}", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=0", "logging.mlflow=false"]
    run(load_config("tiny/t-loopformer", [*QUICK, *over, "schedule.max_steps=4"]))
    assert steps_in(tmp_path / "ck" / "metrics.jsonl") == [1, 2, 3, 4]
    assert not (tmp_path / "mlflow.db").exists()
    # tlf eval: the dead server (from MLFLOW_TRACKING_URI, the checkpoint's logging.tracking_uri being empty) is
    # one line before the evaluation starts
    argv = ["eval", str(tmp_path / "ck"), "--tasks", "none", "--no-ppl", "--no-latency", "--out", str(tmp_path / "e")]
    r = tlf_in_process(*argv, MLFLOW_TRACKING_URI=dead)
    assert r.exit_code == 1 and dead in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "Traceback" not in r.output
    p = subprocess.run(  # the real entry point
        [str(BIN / "tlf"), "compare", "--run-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "t-loopformer" in p.stdout and "Table 3" in p.stdout
    assert (tmp_path / "c" / "loss_curves.png").is_file()


@pytest.mark.slow
def test_redone_steps_reach_mlflow_so_it_agrees_with_the_metrics_file(tmp_path, data, server):
    """A resume that falls back to an earlier checkpoint (the newest one damaged) redoes steps the MLflow run already
    holds: they are sent again, so at every step the run's value (the newest, tracking.metric_history) is the one in
    metrics.jsonl, for every metric; the abandoned attempt's values stay in the history, older, and a run tag names
    the redone steps. The redo runs with another objective weight (a resume may change it), so its losses differ
    from the abandoned ones whatever the machine."""
    from pipeline.tracking import client, metric_history, read_metrics

    uri = server.up().uri
    ck, cl = tmp_path / "ck", client(uri)
    base = ["schedule.max_steps=4", "checkpoint.interval=2", "checkpoint.keep_last=3", "logging.experiment=redo"]
    run_id = re.search(r"MLflow run (\w+)", train(tmp_path, data, uri, *base).finish()).group(1)
    abandoned = dict(metric_history(cl, run_id, "loss"))
    assert sorted(abandoned) == [1, 2, 3, 4]
    f = ck / "global_step4" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:1000])

    out = train(tmp_path, data, uri, *base, "objective.lambda_short=0.5").finish()
    assert f"resumed from {ck / 'global_step2'}" in out and "steps 3-4 redone" in out, out[-3000:]
    lines = read_metrics(ck / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for key in sorted({k for r in lines for k in r} - {"step", "time"}):
        assert metric_history(cl, run_id, key) == [(r["step"], r[key]) for r in lines if key in r], key
    loss = {r["step"]: r["loss"] for r in lines}
    assert [loss[s] == abandoned[s] for s in (1, 2, 3, 4)] == [True, True, False, False]
    kept = sorted((m.step, m.timestamp, m.value) for m in cl.get_metric_history(run_id, "loss"))
    assert [s for s, _, _ in kept] == [1, 2, 3, 3, 4, 4]  # the abandoned attempt's values, older
    assert [v for s, _, v in kept if s > 2] == [abandoned[3], loss[3], abandoned[4], loss[4]]
    run = cl.get_run(run_id)
    assert "steps 3-4 redone from the checkpoint of step 2" in run.data.tags["redo/1"]
    assert run.info.status == "FINISHED" and run.data.metrics["loss"] == loss[4]


def test_a_run_on_a_real_server_as_its_users_browse_it(tmp_path, data, server):
    """`tlf train` against the real server: the experiment is a model-training one, the run has its Source and
    Dataset, the budgets' validation, the data wait and MLflow's system metrics, and tlf prints the UI link that
    opens the run as model training and the charts link that opens the experiment's saved view, whose Headline
    section holds the run's loss, budgets' validation, tokens/s, memory and depth charts."""
    from pipeline.tracking import VIEW_TAG, _unpack, client

    uri = server.up().uri
    out = train(tmp_path, data, uri, "schedule.max_steps=2", "train.eval_interval=2", "logging.experiment=ui").finish()
    run_id = re.search(r"MLflow run (\w+)", out).group(1)
    cl = client(uri)
    run = cl.get_run(run_id)
    assert cl.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert f"MLflow UI: {uri}/#/experiments/{run.info.experiment_id}/runs/{run_id}?workflowType=machine_learning" in out
    assert run.data.tags["mlflow.source.name"] == "tlf train"
    assert [i.dataset.name for i in run.inputs.dataset_inputs] == [data.name]
    metrics = set(run.data.metrics)
    assert {"val/M1/loss", "val/M2/loss", "val/M3/loss", "val/M3/loop_work", "perf/data_wait_ms"} <= metrics
    assert any(k.startswith("system/") for k in metrics)
    exp_page = f"{uri}/#/experiments/{run.info.experiment_id}/runs?workflowType=machine_learning"
    assert f"MLflow charts: {exp_page}&viewStateShareKey=tlf-training&compareRunsMode=CHART" in out
    view = _unpack(cl.get_experiment(run.info.experiment_id).tags[VIEW_TAG])
    assert [c["metricKey"] for c in view["compareRunCharts"]] == [
        "loss", "val/loss", "val/M1/loss", "val/M2/loss", "val/M3/loss", "tokens_per_s", "mem/peak_rss_gb",
        "router/full/mean_depth",
    ]  # fmt: skip
    sections = [s["name"] for s in view["compareRunSections"]]
    assert sections[0] == "Headline" and sections[-1] == "Model metrics"  # system/...: MLflow's monitor, appended
    assert {"perf", "val/M3", "router/short"} <= set(sections) and "val" not in sections  # val/loss: in Headline


def test_the_saved_view_puts_the_headline_first_and_grows_with_the_keys(tmp_path):
    """The experiment's saved view (what tlf's charts link opens; bench/mlflow_ui.py checks it in a browser):
    Headline charts in HEADLINE's order (budgets by number), then the other sections in MLflow's order with the
    zero-shot sections collapsed; keys sent later are merged in."""
    from mlflow.entities import Metric

    from pipeline import tracking

    head, secs = tracking.view_layout(
        ["lr", "val/M10/loss", "val/M2/loss", "loss", "eval/M2/piqa/acc", "mem/peak_rss_gb", "system/cpu", "val/M2/x"]
    )
    assert head == ["loss", "val/M2/loss", "val/M10/loss", "mem/peak_rss_gb"]
    assert secs == ["eval/M2/piqa", "val/M2", "Model metrics", "System metrics"]
    state = tracking.view_state(head, secs)
    assert [(s["name"], s["display"]) for s in state["compareRunSections"]] == [
        ("Headline", True), ("eval/M2/piqa", False), ("val/M2", True), ("Model metrics", True),
        ("System metrics", True),
    ]  # fmt: skip
    assert state["isAccordionReordered"] and {c["metricSectionId"] for c in state["compareRunCharts"]} == {
        "tlf-headline"
    }
    assert tracking._unpack(tracking._pack(state)) == state and tracking._pack(state).count("deflate;") == 1

    cl = tracking.client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracking.experiment_id(cl, "v")
    assert tracking._unpack(cl.get_experiment(exp).tags[tracking.VIEW_TAG])["compareRunCharts"] == []
    run = cl.create_run(exp).info.run_id
    tracking.log_metrics(cl, run, [Metric("loss", 1.0, 0, 1), Metric("grad_norm/emb", 1.0, 0, 1)])
    tracking.log_metrics(cl, run, [Metric("val/M1/loss", 1.0, 0, 2), Metric("val/loss", 1.0, 0, 2)])
    view = tracking._unpack(cl.get_experiment(exp).tags[tracking.VIEW_TAG])
    assert [c["metricKey"] for c in view["compareRunCharts"]] == ["loss", "val/loss", "val/M1/loss"]
    assert [s["name"] for s in view["compareRunSections"]] == ["Headline", "grad_norm"]
    assert tracking.ui_link("http://h:5000/", exp, view=True) == (
        f"http://h:5000/#/experiments/{exp}/runs?workflowType=machine_learning&viewStateShareKey=tlf-training"
        "&compareRunsMode=CHART"
    )
