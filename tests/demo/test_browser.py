"""The demo in a real browser: Debian's Chromium driven by Playwright (never `playwright install`).

Starts the app on a free loopback port, enters a prompt, clicks Generate, and checks that the
base and aligned images render with their scores and the per-checkpoint table; then a bad input
must show a visible error message while the app keeps serving. The screenshot is kept under
``tests/artifacts/`` (its path is printed).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from run_folders import make_run

from flowrl.local_launch import free_port

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

LOADED = "Array.from(document.querySelectorAll('#grid img')).filter(i => i.complete && i.naturalWidth > 0).length"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's Chromium at /usr/bin/chromium: apt-get install -y chromium chromium-driver "
        "(and pip install -e '.[dev,demo]' for playwright + gradio)",
    ),
]


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from flowrl.demo.app import build_app, launch
    from flowrl.demo.registry import RunRegistry

    root = tmp_path_factory.mktemp("runs")
    make_run(root / "aligned", seed=1)
    app = build_app(RunRegistry([root]))
    url = launch(app, host="127.0.0.1", port=free_port(), block=False)
    assert url.startswith("http://127.0.0.1:")
    yield url
    app.close()


@pytest.fixture(scope="module")
def page(demo_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.goto(demo_url)
        page.wait_for_selector("#generate", timeout=60_000)
        yield page
        browser.close()


def fill(page, elem_id: str, text: str) -> None:
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(text)
    box.press("Tab")


def test_generate_shows_base_and_aligned_images_with_scores(page):
    fill(page, "prompt", "a bold handwritten 5")
    fill(page, "seeds", "0, 1")
    fill(page, "steps", "4")
    page.click("#generate")
    page.wait_for_function(
        "document.querySelector('#table') && document.querySelector('#table').innerText.includes('aligned')",
        timeout=120_000,
    )
    try:  # base and aligned, two seeds each, decoded by the browser
        page.wait_for_function(f"{LOADED} >= 4", timeout=30_000)
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "demo-compare.png"), full_page=True)
    grid_text = page.inner_text("#grid")
    assert "base · seed 0" in grid_text and "aligned · seed 1" in grid_text and "total" in grid_text
    table = page.inner_text("#table")
    assert "base" in table and "aligned" in table and "±" in table
    shot = ARTIFACTS / "demo-compare.png"
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_bad_input_shows_an_error_and_the_app_keeps_working(page):
    fill(page, "seeds", "0-99")
    page.click("#generate")
    page.wait_for_selector("text=at most 8 seeds", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-error.png"))
    fill(page, "seeds", "2")
    fill(page, "prompt", "a thin handwritten 1")
    page.click("#generate")
    page.wait_for_function(
        "document.querySelector('#grid') && document.querySelector('#grid').innerText.includes('seed 2')",
        timeout=120_000,
    )


def test_a_path_outside_the_start_folders_is_refused_visibly(page):
    page.click("text=open another run folder")
    box = page.get_by_label("run folder (under the folders the demo was started with)")
    box.fill("../../../etc")
    page.click("#add_run")
    page.wait_for_selector("text=outside the folders this demo was started with", timeout=30_000)
    assert page.locator("#checkpoints label").count() == 2  # still base and aligned only


def test_the_training_curves_tab_plots_the_runs_metrics(page):
    page.get_by_role("tab", name="Training curves").click()
    page.wait_for_selector("#curves img", timeout=30_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-curves.png"), full_page=True)
