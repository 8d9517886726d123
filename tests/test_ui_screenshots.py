"""The screenshot script's views: which page of the MLflow UI each PNG shows."""

from scripts.ui_screenshots import VIEWS, last_tree_image, view_urls


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


def test_the_tree_view_opens_the_last_steps_picture_in_the_artifacts_tab():
    paths = ["images/rollout_trees+step+9+timestamp+1+a.png", "images/rollout_trees+step+19+timestamp+2+b.png",
             "images/rollout_trees+step+19+timestamp+2+b+compressed.webp", "images/other+step+99+timestamp+3+c.png"]
    assert last_tree_image(paths) == "images/rollout_trees+step+19+timestamp+2+b.png"
    assert last_tree_image(["images/other+step+1+timestamp+1+a.png"]) is None
    url = view_urls("http://h:1", "7", "t1", "r1", None, last_tree_image(paths))["ui_tree_images"]
    assert url == "http://h:1/#/experiments/7/runs/t1/artifactPath/images/rollout_trees+step+19+timestamp+2+b.png"
