"""The screenshot script's views: which page of the MLflow UI each PNG shows."""

from scripts.ui_screenshots import VIEWS, view_urls


def test_each_view_opens_its_page_on_the_screenshot_server():
    summary = ("MLflow (`make ui`): [the arms' results](http://127.0.0.1:5000/#/experiments/7/runs?workflowType="
               "machine_learning&viewStateShareKey=abc) (every seed's ...), [compare the arms](http://x).\n")
    urls = view_urls("http://127.0.0.1:5055", "7", "t1", "r1", summary)
    assert list(urls) == list(VIEWS)
    assert urls["ui_runs_by_arm"] == ("http://127.0.0.1:5055/#/experiments/7/runs?workflowType=machine_learning"
                                      "&viewStateShareKey=abc")  # the report's shared view, on this server
    assert urls["ui_rollout_table"] == "http://127.0.0.1:5055/#/experiments/7/runs/t1/artifactPath/rollouts.json"
    assert urls["ui_tree_images"] == "http://127.0.0.1:5055/#/experiments/7/runs/t1/model-metrics"
    assert urls["ui_report"] == "http://127.0.0.1:5055/#/experiments/7/runs/r1/artifactPath/summary.md"
    plain = view_urls("http://h:1", "7", "t1", "r1", None)["ui_runs_by_arm"]
    assert plain == "http://h:1/#/experiments/7/runs?workflowType=machine_learning"
