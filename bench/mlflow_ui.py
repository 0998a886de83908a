"""MLflow as a user browses tlf's runs: starts `mlflow server` on a store (default: the one `make demo` writes),
opens the experiment and a run in headless Chromium (Debian's `chromium`), saves screenshots and prints what it
checks: the experiment's kind (model training, so the UI opens on its runs, not a GenAI app's traces page), the
landing page of tlf's link (`pipeline.tracking.ui_link`), the run table's Dataset and Source columns, the chart
view tlf's charts link opens (its saved view: the Headline section first, with which charts) beside the chart
sections MLflow's own order gives the experiment and a run's page (which sections a user scrolls past before `loss`).

    python bench/mlflow_ui.py                                   # the demo's store: .cache/demo/mlflow.db
    python bench/mlflow_ui.py --store sqlite:///mlflow.db --experiment tlf --out bench/figures/mlflow_ui
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from pipeline import tracking  # noqa: E402  (after the sys.path line above)
from pipeline.train.ds import free_port  # noqa: E402  (as above)


def serve(store: str, port: int) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:port over `store` (one worker, no job runner), up when this returns."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow), "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read() == b"OK":
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"mlflow server on {store} did not answer on port {port}")


def browse(url: str, png: Path | None = None) -> str:
    """The page's DOM after the app has rendered (and a screenshot to png), from headless Chromium."""
    base = [shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu"]
    base += ["--window-size=1600,1000", "--virtual-time-budget=20000"]
    if png is not None:
        subprocess.run([*base, f"--screenshot={png}", url], capture_output=True, timeout=120)
    return subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout


def texts(dom: str) -> list[str]:
    return [t.strip() for t in re.sub(r"<[^>]+>", "\n", dom).split("\n") if t.strip()]


def _names(runs) -> set[str]:
    return {i.dataset.name for r in runs for i in r.inputs.dataset_inputs}


def sections(page: list[str]) -> list[tuple[str, int]]:
    """(name, chart count) of a chart page's sections, in order: a header reads NAME, (COUNT), Add chart."""
    return [
        (page[i - 2], int(page[i - 1][1:-1]))
        for i, t in enumerate(page)
        if t == "Add chart" and i > 1 and re.fullmatch(r"\(\d+\)", page[i - 1])
    ]


def section_charts(page: list[str], name: str, keys: set[str]) -> list[str]:
    """The chart titles (metric keys) shown in section `name`, in order."""
    start = next(i for i in range(len(page) - 2) if page[i] == name and page[i + 2] == "Add chart") + 3
    nxt = next((i for i in range(start, len(page) - 2) if page[i + 2] == "Add chart"), len(page))
    return [t for t in page[start:nxt] if t in keys]


def check(store: str, experiment: str, out: Path) -> dict:
    port = free_port()
    server = serve(store, port)
    try:
        uri = f"http://127.0.0.1:{port}"
        client = tracking.checked_client(uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise SystemExit(f"{store}: no experiment {experiment!r}")
        runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
        run = runs[0]
        keys = {k for r in runs for k in r.data.metrics}
        landing = texts(browse(tracking.ui_link(uri, exp.experiment_id), out / "experiment.png"))
        table = texts(browse(tracking.ui_link(uri, exp.experiment_id), None))
        view_url = tracking.ui_link(uri, exp.experiment_id, view=True)
        view = texts(browse(view_url, out / "charts_view.png"))
        plain_url = f"{uri}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART"
        plain = texts(browse(plain_url, out / "charts_mlflow_order.png"))
        run_page = texts(
            browse(
                tracking.ui_link(uri, exp.experiment_id, run.info.run_id).replace("?", "/model-metrics?"),
                out / "run_charts.png",
            )
        )
        in_view = sections(view)
        stored = tracking._unpack(exp.tags[tracking.VIEW_TAG]) if tracking.VIEW_TAG in exp.tags else None
        res = {
            "store": store,
            "experiment": experiment,
            "runs": len(runs),
            "experiment_kind": exp.tags.get("mlflow.experimentKind"),
            "landing_title": next((t for t in landing if t in ("Runs", "Overview", "Training runs")), None),
            "datasets": {r.info.run_name: [i.dataset.name for i in r.inputs.dataset_inputs] for r in runs},
            "sources": {r.info.run_name: r.data.tags.get("mlflow.source.name") for r in runs},
            "dataset_column_filled": any(t.startswith(f"{ds} (") for t in table for ds in _names(runs)),
            "view_url": view_url,
            "view_active": tracking.VIEW_NAME in view and "Exit shared view" in view,
            "view_sections": in_view,
            "view_collapsed": [s["name"] for s in (stored or {}).get("compareRunSections", []) if not s["display"]],
            "headline_first": bool(in_view) and in_view[0][0] == tracking.HEADLINE_SECTION,
            "headline_charts": section_charts(view, tracking.HEADLINE_SECTION, keys) if in_view else [],
            "headline_stored": [c["metricKey"] for c in (stored or {}).get("compareRunCharts", [])],
            "mlflow_order_sections": [n for n, _ in sections(plain)],
            "run_page_sections": [n for n, _ in sections(run_page)],
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=f"sqlite:///{REPO / '.cache' / 'demo' / 'mlflow.db'}")
    ap.add_argument("--experiment", default="demo")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "figures" / "mlflow_ui")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    res = check(a.store, a.experiment, a.out)
    (a.out / "mlflow_ui.json").write_text(json.dumps(res, indent=1))
    print(f"experiment kind: {res['experiment_kind']} (custom_model_development: the UI opens on its runs)")
    print(f"tlf's link lands on: {res['landing_title']}  ({a.out / 'experiment.png'})")
    print(f"Dataset column filled: {res['dataset_column_filled']}; datasets {res['datasets']}")
    print(f"Source column: {res['sources']}")
    print(f"charts link: {res['view_url']}")
    print(f"  opens tlf's saved view '{tracking.VIEW_NAME}': {res['view_active']}  ({a.out / 'charts_view.png'})")
    print(f"  sections in order (name, charts): {res['view_sections']}")
    print(f"  first section is '{tracking.HEADLINE_SECTION}': {res['headline_first']}")
    print(f"  its charts rendered in the window: {res['headline_charts']}")
    print(f"  the view's headline charts (experiment tag {tracking.VIEW_TAG}): {res['headline_stored']}")
    print(f"  sections the view starts collapsed: {res['view_collapsed']}")
    print(f"MLflow's own order, the same experiment's charts without the view: {res['mlflow_order_sections']}")
    print(f"  ({a.out / 'charts_mlflow_order.png'})")
    print(f"a run's own page (its layout is kept in the browser only): {res['run_page_sections']}")
    print(f"  ({a.out / 'run_charts.png'})")
    if not (res["view_active"] and res["headline_first"] and "loss" in res["headline_charts"]):
        raise SystemExit("the charts link does not open the Headline section first")


if __name__ == "__main__":
    main()
