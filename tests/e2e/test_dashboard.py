"""The web dashboard in a real headless Chromium against a real ``tuneq dev`` training a job.

Debian's ``chromium`` package, driven by Playwright with ``executable_path`` (no browser
download). The page's charts must draw points while the job runs, fed by the event stream;
a screenshot is kept under ``$TUNEQ_TEST_ARTIFACTS`` (default ``tests/artifacts/``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config
from tests.conftest import require_service

from .harness import Tuneq

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("TUNEQ_TEST_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TUNEQ_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / "artifacts")
TIMEOUT_MS = 180_000  # the first steps wait for DeepSpeed to start its ranks


@pytest.fixture
def chromium() -> Iterator[Any]:
    if shutil.which(CHROMIUM) is None:
        require_service("Chromium", f"{CHROMIUM} not found (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root, where Chromium refuses its sandbox.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def long_job(model: Path, dataset: Path) -> dict[str, Any]:
    """Runs until cancelled, with frequent checkpoints so the page lists some."""
    return {
        "name": "dashboard-e2e",
        "model": str(model),
        "dataset": str(dataset),
        "deepspeed_config": seed_config(fp16=False, lr=1e-3),
        "training": {"max_seq_length": 48, "epochs": 1000, "max_steps": 100_000, "checkpoint_every_steps": 3},
    }


def points(page: Any, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-points") or 0)


def test_dashboard_shows_a_running_job_live_pauses_and_cancels_it(
    chromium: Any, tuneq_home: Path, tiny_model: Path, text_dataset: Path
) -> None:
    tuneq = Tuneq(home=tuneq_home).start()
    try:
        job = tuneq.submit(long_job(tiny_model, text_dataset))
        page = chromium.new_page(viewport={"width": 1100, "height": 900})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"http://127.0.0.1:{tuneq.port}/")

        # The jobs table lists the job with its status, model and progress.
        row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
        row.wait_for()
        assert "dashboard-e2e" in row.inner_text()
        assert str(tiny_model) in row.locator("td.model").inner_text()
        assert row.locator("td.status").inner_text() in ("queued", "running")

        row.locator("a").click()
        page.wait_for_url(f"**/#/jobs/{job['id']}")
        page.wait_for_function(
            "document.querySelector('#job-status').textContent === 'running'"
            " && Number(document.querySelector('#loss-chart').dataset.points) >= 2"
        )
        # Points keep arriving while the job runs: the stream is live, not a one-off replay.
        seen = points(page, "loss-chart")
        page.wait_for_function(f"Number(document.querySelector('#loss-chart').dataset.points) > {seen}")
        assert page.text_content("#job-status") == "running"
        assert points(page, "lr-chart") >= 2
        # The line has a vertex per counted point (read in one go: points keep arriving, and
        # past a few dozen the chart draws the line without markers).
        counted, vertices = page.evaluate(
            "() => { const c = document.querySelector('#loss-chart');"
            " const line = c.querySelector('polyline.line');"
            " return [Number(c.dataset.points), line ? line.getAttribute('points').trim().split(/\\s+/).length : 0]; }"
        )
        assert vertices == counted >= 2

        # Checkpoints every 3 steps, and the worker's log tail.
        page.locator("#checkpoints li").first.wait_for()
        assert "step 3" in page.inner_text("#checkpoints")
        page.wait_for_function("document.querySelector('#log-tail').textContent.trim().length > 0")

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        screenshot = ARTIFACTS / "dashboard.png"
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 0

        # The pause button pauses the running job (its ranks checkpoint and exit); the page
        # follows it to `paused` and offers to resume it instead.
        assert page.text_content("#pause-button") == "Pause" and page.is_enabled("#pause-button")
        page.click("#pause-button")
        page.wait_for_function("document.querySelector('#job-status').textContent === 'paused'")
        page.wait_for_function("document.querySelector('#pause-button').textContent === 'Resume'")
        assert page.is_enabled("#pause-button")
        # The cancel button stops the job (a paused one at once); the page follows it to `cancelled`.
        page.click("#cancel-button")
        page.wait_for_function("document.querySelector('#job-status').textContent === 'cancelled'")
        assert tuneq.wait(job["id"], timeout=60)["status"] == "cancelled"
        assert page.is_disabled("#cancel-button") and page.is_disabled("#pause-button")
        assert errors == []
    finally:
        tuneq.stop()


def test_with_auth_on_the_page_asks_for_a_key_and_keeps_it(
    chromium: Any, tuneq_home: Path, tiny_model: Path, text_dataset: Path
) -> None:
    tuneq = Tuneq(home=tuneq_home, env={"TUNEQ_AUTH": "on"}).start()
    try:
        key = tuneq.create_key("dana")
        tuneq.client.headers["Authorization"] = f"Bearer {key}"
        body = long_job(tiny_model, text_dataset)
        body["training"].update(epochs=1, max_steps=3, checkpoint_every_steps=None)
        job = tuneq.wait(tuneq.submit(body)["id"], timeout=300)
        assert job["status"] == "succeeded", job["error"]

        page = chromium.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"http://127.0.0.1:{tuneq.port}/")
        page.locator("#key-form").wait_for()  # the 401 from /jobs shows the form
        page.fill("#api-key", key)
        page.click("#key-form button")
        page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]').wait_for()
        assert page.is_hidden("#key-form")

        # The key is kept across reloads, and the event stream (read with fetch, which can send
        # the header) replays the finished job's steps into the charts.
        page.goto(f"http://127.0.0.1:{tuneq.port}/#/jobs/{job['id']}")
        page.wait_for_function("document.querySelector('#job-status').textContent === 'succeeded'")
        page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) === 3")
        assert points(page, "lr-chart") == 3
        assert page.is_hidden("#key-form") and page.is_disabled("#cancel-button")
    finally:
        tuneq.stop()
