"""The web dashboard in a real headless Chromium against a real ``tuneq dev`` training a job.

Debian's ``chromium`` package, driven by Playwright with ``executable_path`` (no browser
download). Each view is checked at desktop width in light mode and at 390 px in dark mode (the
compare, workers and submit views in all four), with axe-core (no serious or critical violation)
and no console error; screenshots are written under
``$TUNEQ_TEST_ARTIFACTS`` (default ``tests/artifacts/``, which git ignores) for a developer to open.
One service serves all of the first test's checks: starting it and training is the slow part.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
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
DASHBOARD_SOURCES = Path(__file__).resolve().parents[2] / "dashboard"
TIMEOUT_MS = 180_000  # the first steps wait for DeepSpeed to start its ranks
DESKTOP = {"viewport": {"width": 1280, "height": 900}, "color_scheme": "light"}
PHONE = {"viewport": {"width": 390, "height": 844}, "color_scheme": "dark", "is_mobile": True, "has_touch": True}
DESKTOP_DARK = {**DESKTOP, "color_scheme": "dark"}
PHONE_LIGHT = {**PHONE, "color_scheme": "light"}


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


@pytest.fixture(scope="module")
def axe_source() -> str:
    """axe-core's script, from the npm package dashboard/package-lock.json pins."""
    script = DASHBOARD_SOURCES / "node_modules" / "axe-core" / "axe.min.js"
    if not script.exists():
        if shutil.which("npm") is None:
            require_service("npm", "needed to install axe-core (apt-get install npm)")
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=DASHBOARD_SOURCES, check=True)
    return script.read_text()


class Watched:
    """A page whose console errors and failed requests are collected (an expected 404 aside)."""

    def __init__(self, browser: Any, options: dict[str, Any], base: str) -> None:
        self.context = browser.new_context(**options)
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.base = base
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.expected_404: set[str] = set()
        self.expected_422: set[str] = set()  # paths a test sends a refused body to on purpose
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("console", self._console)
        self.page.on("request", lambda r: self.requests.append(r.url))

    def _console(self, message: Any) -> None:
        if message.type != "error":
            return
        url = message.location.get("url", "")
        if "404" in message.text and any(part in url for part in self.expected_404):
            return
        if "422" in message.text and any(url.endswith(path) for path in self.expected_422):
            return
        self.errors.append(f"console: {message.text} ({url})")

    def open(self, hash_route: str) -> Any:
        self.page.goto(f"{self.base}/{hash_route}")
        return self.page

    def close(self) -> None:
        self.context.close()


def check_accessible(page: Any, axe_source: str, where: str) -> None:
    page.add_script_tag(content=axe_source)
    results = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']][:3]}"
        for v in results["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert serious == [], f"axe-core, {where}:\n" + "\n".join(serious)


def screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def fits_width(page: Any) -> bool:
    """Nothing but scroll boxes made for it (the tables') is wider than the window."""
    return bool(page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth + 1"))


def long_job(model: Path, dataset: Path, name: str = "dashboard-e2e") -> dict[str, Any]:
    """Runs until cancelled, with frequent checkpoints so the page lists some."""
    return {
        "name": name,
        "model": str(model),
        "dataset": str(dataset),
        "deepspeed_config": seed_config(fp16=False, lr=1e-3),
        "training": {"max_seq_length": 48, "epochs": 1000, "max_steps": 100_000, "checkpoint_every_steps": 3},
    }


def points(page: Any, chart: str) -> int:
    return int(page.get_attribute(f"#{chart}", "data-points") or 0)


def check_jobs_list(watched: Watched, job: dict[str, Any], axe_source: str, name: str) -> None:
    page = watched.open("#/jobs?status=running")
    row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
    row.wait_for()
    assert "dashboard-e2e" in row.inner_text() and job["id"][:8] in row.locator("td.job code").inner_text()
    page.wait_for_function(
        f"document.querySelector('tr[data-job-id=\"{job['id']}\"] td.speed').textContent.includes('tok/s')"
    )
    assert "lr" in row.locator("td.hyper").inner_text()
    assert page.input_value("#filter-status") == "running"  # the filter is read from the URL
    check_accessible(page, axe_source, f"jobs list, {name}")
    assert fits_width(page), f"jobs list overflows at {name}"
    screenshot(page, f"jobs-{name}")


def check_job_page(watched: Watched, job: dict[str, Any], axe_source: str, name: str) -> None:
    page = watched.open(f"#/jobs/{job['id']}")
    page.wait_for_function("document.querySelector('#job-status')?.textContent === 'running'")
    page.wait_for_function("Number(document.querySelector('#loss-chart')?.dataset.points) >= 2")
    page.locator("#artifacts li").first.wait_for()
    page.wait_for_function("document.querySelector('#log').textContent.trim().length > 0")
    check_accessible(page, axe_source, f"job page, {name}")
    assert fits_width(page), f"job page overflows at {name}"
    screenshot(page, f"job-{name}")


def submit_through_form(watched: Watched, model: Path, dataset: Path, axe_source: str) -> str:
    """Fills the submit form: an upload, a refused plan whose problem shows beside its field, a
    plan, then Submit, which opens the new job's page. The new job's id."""
    page = watched.open("#/submit")
    page.locator(f'#base-models option[value="{model}"]').wait_for(state="attached")  # offered base models
    page.fill("#submit-model", str(model))
    chat = dataset.with_name("chat.jsonl")
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
            )
            + "\n"
            for i in range(8)
        )
    )
    page.set_input_files("#submit-upload", str(chat))  # POST /v1/files: the dataset is the file's id
    page.wait_for_function("document.querySelector('#submit-dataset').value.startsWith('file-')")
    page.fill("#submit-dataset", str(dataset))
    page.fill("#submit-name", "dashboard-form")
    page.fill("#submit-max-steps", "three")
    page.fill("#submit-max-seq-length", "48")
    page.fill("#submit-deepspeed", json.dumps(seed_config(fp16=False, lr=3e-4)))
    watched.expected_422.add("/jobs/plan")
    page.click("#plan-button")  # the 422's problem is beside the field its loc names
    page.locator("#submit-max-steps-error").wait_for()
    assert "integer" in page.inner_text("#submit-max-steps-error")
    assert page.get_attribute("#submit-max-steps", "aria-invalid") == "true" and page.is_disabled("#submit-button")
    check_accessible(page, axe_source, "submit form with a problem")
    screenshot(page, "submit-refused-desktop-light")
    page.fill("#submit-max-steps", "3")
    page.click("#plan-button")
    page.locator("#plan").wait_for()
    assert "3 (" in page.inner_text("#plan .facts") and '"optimizer"' in page.inner_text("#plan pre")
    assert page.locator("#submit-max-steps-error").count() == 0
    screenshot(page, "submit-planned-desktop-light")
    page.click("#submit-button")
    page.wait_for_url("**/#/jobs/*")
    page.wait_for_function("document.querySelector('#job-title')?.textContent === 'dashboard-form'")
    return page.url.rpartition("/")[2]


def pick_and_compare(watched: Watched, ids: list[str]) -> None:
    """Ticks the jobs in the list and presses Compare: the comparison's URL names them."""
    page = watched.open("#/jobs")
    for job_id in ids:
        page.locator(f'#jobs-table tr[data-job-id="{job_id}"] td.pick input').check()
    page.click("#compare-button")
    page.wait_for_url(f"**/#/compare?jobs={','.join(ids)}")


def check_compare(watched: Watched, ids: list[str], axe_source: str, name: str) -> None:
    page = watched.open(f"#/compare?jobs={','.join(ids)}")
    page.wait_for_function(f"document.querySelectorAll('#compare-legend li').length === {len(ids)}")
    page.wait_for_function("Number(document.querySelector('#compare-loss')?.dataset.points) >= 2")
    for chart in ("compare-eval-loss", "compare-lr", "compare-speed"):
        assert page.locator(f"#{chart}").count() == 1, chart
    assert page.locator("#compare-rewards-margins").count() == 0  # SFT jobs: no DPO rewards
    settings = page.locator("#compare-table tbody th").all_inner_texts()
    assert settings[0] == "model" and "training.max_steps" in settings and "deepspeed.optimizer.params.lr" in settings
    assert "training.max_seq_length" not in settings  # the same in both: not shown
    check_accessible(page, axe_source, f"compare, {name}")
    assert fits_width(page), f"compare overflows at {name}"
    screenshot(page, f"compare-{name}")


def check_workers(watched: Watched, job: dict[str, Any], axe_source: str, name: str) -> None:
    """The service's worker runs the caller's job: busy, with the job's id; the queued job counts."""
    page = watched.open("#/workers")
    row = page.locator(f'#workers-table tr:has(a[href="#/jobs/{job["id"]}"])')
    row.wait_for()
    assert row.locator(".worker-state").inner_text() == "busy" and "ago" in row.locator("td.heartbeat").inner_text()
    page.wait_for_function(
        "[...document.querySelectorAll('#queues-table td.queued')].some((td) => td.textContent !== '0')"
    )
    assert page.locator("#gangs-empty").count() == 1
    check_accessible(page, axe_source, f"workers, {name}")
    assert fits_width(page), f"workers overflow at {name}"
    screenshot(page, f"workers-{name}")


def check_submit_page(watched: Watched, axe_source: str, name: str) -> None:
    page = watched.open("#/submit")
    page.locator("#base-models option").first.wait_for(state="attached")
    check_accessible(page, axe_source, f"submit, {name}")
    assert fits_width(page), f"submit overflows at {name}"
    screenshot(page, f"submit-{name}")


def check_new_views(chromium: Any, base: str, ids: list[str], job: dict[str, Any], axe_source: str) -> None:
    """Compare, workers and submit at desktop and at 390 px, in light and in dark mode."""
    looks: list[tuple[dict[str, Any], str]] = [
        (DESKTOP, "desktop-light"),
        (DESKTOP_DARK, "desktop-dark"),
        (PHONE, "390px-dark"),
        (PHONE_LIGHT, "390px-light"),
    ]
    for options, name in looks:
        watched = Watched(chromium, options, base)
        try:
            check_compare(watched, ids, axe_source, name)
            check_workers(watched, job, axe_source, name)
            check_submit_page(watched, axe_source, name)
            assert watched.errors == [], json.dumps(watched.errors, indent=1)
        finally:
            watched.close()


def test_dashboard_lists_shows_controls_and_forgets_a_job(
    chromium: Any, axe_source: str, tuneq_home: Path, tiny_model: Path, text_dataset: Path
) -> None:
    tuneq = Tuneq(home=tuneq_home).start()
    base = f"http://127.0.0.1:{tuneq.port}"
    desktop = Watched(chromium, DESKTOP, base)
    phone = Watched(chromium, PHONE, base)
    try:
        job = tuneq.submit(long_job(tiny_model, text_dataset))
        page = desktop.open("#/jobs")

        # The list: the job's row, its short id, model and status; a filter is a URL.
        row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
        row.wait_for()
        assert str(tiny_model) in row.locator("td.model").inner_text()
        page.select_option("#filter-status", "failed")
        page.wait_for_url("**/#/jobs?status=failed")
        row.wait_for(state="detached")
        page.fill("#filter-name", "e2e")
        page.press("#filter-name", "Enter")
        page.wait_for_url("**/#/jobs?status=failed&name=e2e")
        page.goto(f"{base}/#/jobs?name=dashboard")
        row.wait_for()
        page.click("th button.sort >> text=Job")
        page.wait_for_url("**/#/jobs?name=dashboard&sort=name")

        # The job page: live charts, the log, checkpoints as links with sizes, the timeline.
        row.locator("td.job a").click()
        page.wait_for_url(f"**/#/jobs/{job['id']}")
        page.wait_for_function(
            "document.querySelector('#job-status')?.textContent === 'running'"
            " && Number(document.querySelector('#loss-chart')?.dataset.points) >= 2"
        )
        seen = points(page, "loss-chart")  # points keep arriving: the stream is live
        page.wait_for_function(f"Number(document.querySelector('#loss-chart').dataset.points) > {seen}")
        for chart in ("lr-chart", "speed-chart", "grad-norm-chart"):
            assert points(page, chart) >= 1, chart
        assert page.locator("#rewards-chart").count() == 0  # an SFT job has no DPO rewards
        page.check("#loss-chart .log-toggle input")  # the log scale redraws the same points
        assert points(page, "loss-chart") >= seen
        page.locator("#artifacts li").first.wait_for()
        link = page.locator("#artifacts a").first
        assert link.get_attribute("href").startswith(f"/jobs/{job['id']}/artifacts/")
        assert "iB" in page.inner_text("#artifacts")  # sizes
        assert "running" in page.inner_text("#timeline")
        page.wait_for_function("document.querySelector('#log').textContent.trim().length > 0")
        page.fill("#log-search", "no line has this text")
        page.wait_for_function("document.querySelector('#log').textContent === ''")
        page.fill("#log-search", "")
        assert page.inner_text("#fact-elapsed").endswith("s")  # "12s", "1m 3s"

        check_jobs_list(desktop, job, axe_source, "desktop-light")
        check_jobs_list(phone, job, axe_source, "390px-dark")
        check_job_page(desktop, job, axe_source, "desktop-light")
        check_job_page(phone, job, axe_source, "390px-dark")

        # A second job through the submit form (it waits in the queue behind the first), both
        # ticked in the list and compared; the workers view shows the first running.
        second = submit_through_form(desktop, tiny_model, text_dataset, axe_source)
        pick_and_compare(desktop, [job["id"], second])
        check_new_views(chromium, base, [job["id"], second], job, axe_source)
        assert tuneq.client.post(f"/jobs/{second}/cancel").json()["status"] == "cancelled"

        # Going from the job to an unknown id: "not found", and every poll and stream of the
        # first job stops (no request for it after the move).
        missing = str(uuid.uuid4())
        desktop.expected_404.add(missing)
        page = desktop.page
        page.evaluate(f"location.hash = '#/jobs/{missing}'")
        page.locator("#job-missing").wait_for()
        assert page.locator("#job-status").count() == 0 and page.locator("#loss-chart").count() == 0
        time.sleep(0.5)  # requests already in flight end
        before = len(desktop.requests)
        time.sleep(5)  # more than two poll periods
        later = desktop.requests[before:]
        assert [u for u in later if job["id"] in u or missing in u] == [], later
        page.evaluate("location.hash = '#/jobs/not-a-job'")
        page.wait_for_function("document.querySelector('#job-missing')?.textContent.includes('not-a-job')")

        # Pause, then Cancel, which asks first.
        page = desktop.open(f"#/jobs/{job['id']}")
        page.wait_for_function("document.querySelector('#pause-button')?.textContent === 'Pause'")
        page.click("#pause-button")
        page.wait_for_function("document.querySelector('#job-status').textContent === 'paused'")
        page.wait_for_function("document.querySelector('#pause-button').textContent === 'Resume'")
        page.click("#cancel-button")
        assert page.locator("#cancel-dialog").is_visible()
        check_accessible(page, axe_source, "cancel dialog")
        page.click("#cancel-dialog button[value=keep]")  # "Keep running": nothing happens
        assert not page.locator("#cancel-dialog").is_visible()
        time.sleep(1)
        assert tuneq.job(job["id"])["status"] == "paused"
        page.click("#cancel-button")
        page.click("#cancel-confirm")
        page.wait_for_function("document.querySelector('#job-status').textContent === 'cancelled'")
        assert tuneq.wait(job["id"], timeout=60)["status"] == "cancelled"
        assert page.is_disabled("#cancel-button") and page.is_disabled("#pause-button")
        assert desktop.errors == [] and phone.errors == [], json.dumps(desktop.errors + phone.errors, indent=1)
    finally:
        desktop.close()
        phone.close()
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
        assert page.locator("#key-form").count() == 0
        assert page.locator("#filter-owner").count() == 0  # dana's key lists dana's jobs: no owner filter

        # The key is kept across reloads, and the metrics (read with fetch, which can send the
        # header) fill the charts of the finished job.
        page.goto(f"http://127.0.0.1:{tuneq.port}/#/jobs/{job['id']}")
        page.wait_for_function("document.querySelector('#job-status')?.textContent === 'succeeded'")
        page.wait_for_function("Number(document.querySelector('#loss-chart').dataset.points) === 3")
        assert points(page, "lr-chart") == 3
        assert page.locator("#key-form").count() == 0 and page.is_disabled("#cancel-button")
        # A file's link cannot send the key: the page makes a 10-minute link (POST
        # /jobs/{id}/downloads) that the browser downloads straight to disk.
        page.locator("#artifacts li").first.wait_for()
        page.locator('#artifacts li[data-group="log"] summary').click()
        with page.expect_download() as download:
            page.locator('#artifacts li[data-group="log"] a').first.click()
        saved = Path(download.value.path())
        assert download.value.url.startswith(f"http://127.0.0.1:{tuneq.port}/downloads/dl_")
        assert "rank0" in saved.read_text(errors="replace")  # the job's log, as the ranks wrote it

        # An admin's key (`tuneq keys create --admin`) lists every owner's jobs, with their owner,
        # and can narrow them to one owner.
        page.evaluate("localStorage.clear()")
        page.goto(f"http://127.0.0.1:{tuneq.port}/")
        page.locator("#key-form").wait_for()
        page.fill("#api-key", tuneq.create_key("ops", admin=True))
        page.click("#key-form button")
        row = page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')
        row.wait_for()
        assert row.locator("td.owner").inner_text() == "dana"
        page.fill("#filter-owner", "erin")
        page.press("#filter-owner", "Enter")
        page.locator("p.empty").wait_for()
        assert "owner=erin" in page.url
    finally:
        tuneq.stop()


def test_a_dpo_gangs_page_charts_its_rewards_and_lists_its_nodes(
    chromium: Any, axe_source: str, tuneq_home: Path
) -> None:
    """A finished two-node DPO job, written to the service's database as its workers would have
    (the DPO and multi-node paths themselves run in tests/e2e/test_dpo.py and test_multi_node.py):
    its page draws the reward and reward-accuracy charts and lists the nodes with their ranks."""
    from sqlalchemy import create_engine
    from sqlmodel import Session

    from shared.db.models import Job, JobMetric, JobNode, NodeState, utcnow
    from shared.jobs.status import JobStatus

    tuneq = Tuneq(home=tuneq_home).start()
    engine = create_engine(f"sqlite:///{tuneq.home / 'tuneq.sqlite'}")
    now = utcnow()
    job = Job(
        name="dpo-gang",
        model="/models/tiny",
        dataset="/data/pairs.jsonl",
        deepspeed_config=seed_config(fp16=False),
        num_gpus=1,
        num_nodes=2,
        training={"method": "dpo", "max_steps": 6},
        status=JobStatus.succeeded,
        attempts=1,
        step=6,
        total_steps=6,
    )
    rows: list[Any] = [
        JobMetric(
            job_id=job.id,
            step=step,
            time=now,
            loss=0.69 - 0.05 * step,
            learning_rate=1e-5,
            rewards_chosen=0.1 * step,
            rewards_rejected=-0.1 * step,
            rewards_margins=0.2 * step,
            rewards_accuracies=min(1.0, 0.5 + 0.1 * step),
        )
        for step in range(1, 7)
    ]
    rows += [
        JobNode(
            job_id=job.id,
            attempt=1,
            node_rank=rank,
            worker_id=f"host-{rank}",
            address=f"10.0.0.{rank + 1}",
            port=29500 if rank == 0 else None,
            state=NodeState.finished,
            lease_expires_at=now,
        )
        for rank in (0, 1)
    ]
    job_id = job.id
    with Session(engine) as session:
        session.add(job)
        session.commit()
        session.add_all(rows)
        session.commit()
    engine.dispose()
    watched = Watched(chromium, DESKTOP, f"http://127.0.0.1:{tuneq.port}")
    try:
        page = watched.open(f"#/jobs/{job_id}")
        page.wait_for_function("document.querySelector('#job-status')?.textContent === 'succeeded'")
        # Each chart's points, over its series: chosen, rejected and margins; the training accuracy.
        page.wait_for_function("Number(document.querySelector('#rewards-chart')?.dataset.points) === 18")
        assert points(page, "accuracy-chart") == 6
        nodes = page.locator("#nodes-table tbody tr")
        assert nodes.count() == 2
        assert "host-1" in nodes.nth(1).inner_text() and "10.0.0.2" in nodes.nth(1).inner_text()
        check_accessible(page, axe_source, "a DPO gang's page")
        screenshot(page, "job-dpo-gang")
        assert watched.errors == [], json.dumps(watched.errors, indent=1)
    finally:
        watched.close()
        tuneq.stop()
