"""Screenshots of the MLflow UI over a finished run, taken by headless Chromium: what a person sees.

Starts ``mlflow ui`` on 127.0.0.1 over the run's tracking database (``make ui``'s), then saves one PNG per view:

- ``ui_runs_by_arm.png``: the runs table in the view the report links as "the arms' results" (every seed's
  evaluate run grouped by arm; the link is read from ``reports/summary.md``);
- ``ui_rollout_table.png``: a train run's ``rollouts.json`` table (``trace.tracking.rollouts``);
- ``ui_tree_images.png``: the same run's last ``rollout_trees`` picture, opened in its *Artifacts* tab (the
  ``images/`` folder lists one picture per evaluation step; the *Model metrics* tab's image card needs a click on
  its step slider, which a headless shot cannot give);
- ``ui_report.png``: the report run's ``summary.md``, rendered as Markdown.

Chromium is Debian's package (``apt-get install -y chromium``); nothing is downloaded at run time. The MLflow UI is
a JavaScript page, so each shot gives it ``--virtual-time-budget`` milliseconds to load its data.

Usage:
    python -m scripts.ui_screenshots [--out docs/images] [--arm trace] [--port 5055] [--browser chromium]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

REPO_ROOT = Path(__file__).resolve().parents[1]
VIEWS = ("ui_runs_by_arm", "ui_rollout_table", "ui_tree_images", "ui_report")
_ARMS_LINK = re.compile(r"\[the arms' results\]\((?P<url>[^)]+)\)")


def view_urls(base_url: str, experiment_id: str, train_run_id: str, report_run_id: str,
              summary_text: str | None, tree_image: str | None = None) -> dict[str, str]:
    """The URL of each view (``VIEWS``) on the MLflow UI at ``base_url``.

    Args:
        base_url: e.g. ``http://127.0.0.1:5055``.
        experiment_id: the experiment of the runs.
        train_run_id: a train run that logged ``rollouts.json`` and the tree pictures.
        report_run_id: the report stage's run.
        summary_text: ``reports/summary.md``; its "the arms' results" link (written for ``make ui``'s address)
            is moved to ``base_url``. None, or a summary without the link, shows the experiment's runs table.
        tree_image: the artifact path of a ``rollout_trees`` picture of the train run (``images/...png``);
            None shows the run's *Model metrics* tab instead.

    Returns:
        ``{view: url}`` in ``VIEWS`` order.
    """
    runs = f"{base_url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    found = _ARMS_LINK.search(summary_text or "")
    if found:
        runs = base_url + found.group("url")[found.group("url").index("/#/"):]
    run = f"{base_url}/#/experiments/{experiment_id}/runs"
    return {"ui_runs_by_arm": runs,
            "ui_rollout_table": f"{run}/{train_run_id}/artifactPath/rollouts.json",
            "ui_tree_images": (f"{run}/{train_run_id}/artifactPath/{quote(tree_image, safe='/+')}" if tree_image
                               else f"{run}/{train_run_id}/model-metrics"),
            "ui_report": f"{run}/{report_run_id}/artifactPath/summary.md"}


def last_tree_image(artifact_paths: list[str]) -> str | None:
    """The ``rollout_trees`` PNG of the highest step among a run's ``images/`` artifacts, or None.

    MLflow names each logged image ``images/<key>+step+<step>+timestamp+<ms>+<uuid>.png`` (and a compressed
    ``.webp`` beside it).
    """
    found = [(int(m.group(1)), path) for path in artifact_paths
             if (m := re.search(r"rollout_trees\+step\+(\d+)\+.*(?<!compressed)\.png$", path))]
    return max(found)[1] if found else None


def _newest_run(client, experiment_id: str, stage: str, arm: str | None = None):
    query = f"tags.`trace.stage` = '{stage}' and attributes.status = 'FINISHED'"
    if arm:
        query += f" and tags.`trace.ablation` = '{arm}'"
    runs = client.search_runs([experiment_id], query, order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: no finished {stage} run{f' of {arm}' if arm else ''} in the experiment: run "
                         "`make run` first")
    return runs[0]


def screenshot(browser: str, url: str, path: Path, width: int = 1600, height: int = 1000,
               budget_ms: int = 20000) -> None:
    """One headless Chromium screenshot of ``url`` into ``path`` (PNG).

    Raises:
        SystemExit: Chromium failed or wrote no file (the message has its last output line).
    """
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--screenshot={path}", f"--window-size={width},{height}",
                          f"--virtual-time-budget={budget_ms}", url], capture_output=True, text=True, timeout=180)
    if out.returncode != 0 or not path.is_file():
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: {browser} could not take {path.name} ({last})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "images")
    parser.add_argument("--params", type=Path, default=REPO_ROOT / "params.yaml")
    parser.add_argument("--arm", default="trace", help="the arm whose train run shows its rollouts")
    parser.add_argument("--port", type=int, default=5055)
    parser.add_argument("--browser", default="chromium")
    args = parser.parse_args(argv)
    if shutil.which(args.browser) is None:
        raise SystemExit(f"error: {args.browser} not found: apt-get install -y chromium (or pass --browser)")
    from mlflow.tracking import MlflowClient

    from trace.configuration.params_file import load_config
    from trace.tracking.experiment import resolve_tracking_uri

    cfg = load_config(args.params)
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    if experiment is None:
        raise SystemExit(f"error: no MLflow experiment {cfg.tracking.experiment_name!r} at {uri}: run `make run` first")
    train = _newest_run(client, experiment.experiment_id, "train", args.arm)
    report = _newest_run(client, experiment.experiment_id, "report")
    summary = REPO_ROOT / "reports" / "summary.md"
    base = f"http://127.0.0.1:{args.port}"
    images = last_tree_image([a.path for a in client.list_artifacts(train.info.run_id, "images")])
    urls = view_urls(base, experiment.experiment_id, train.info.run_id, report.info.run_id,
                     summary.read_text() if summary.is_file() else None, images)
    mlflow = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen([str(mlflow), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port",
                               str(args.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        from benchmarks.grid import wait_http

        try:
            wait_http(f"{base}/health", 90, server)
        except RuntimeError as err:
            raise SystemExit(f"error: the MLflow UI did not start: {err}") from None
        args.out.mkdir(parents=True, exist_ok=True)
        for view, url in urls.items():
            screenshot(args.browser, url, args.out / f"{view}.png")
            print(f"{args.out / (view + '.png')}: {url}")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
