"""The dashboard in a real browser: `streamlit run` on loopback (as `scaletrain ui` starts it),
opened in Debian's headless Chromium through Playwright, on the database of a real run, and on a
simulated cluster of 512 ranks on 64 nodes for the node view.

Screenshots of each page go to test-artifacts/ (ui-overview.png, ui-run-health.png) for a person
to look at; the test fails if an expected element is missing or Streamlit shows an exception. A
copy of the run marked running shows that a live run's page refreshes by itself.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright
from sqlalchemy import update
from ui_testing import RealRun

from scaletrain.app.stack import free_port
from telemetry.client import rank_step
from telemetry.config import TelemetryConfig
from telemetry.db import connect
from telemetry.models import Run
from telemetry.server import start
from telemetry.simulated_cluster import Cluster, simulate
from telemetry.store import TelemetryStore
from ui.launch import ui_command, ui_environment
from ui.source import REFRESH_S

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# Streamlit's own markers: a chart drawn, the "running" widget, an exception box.
CHART = '[data-testid="stVegaLiteChart"]'
RUNNING = '[data-testid="stStatusWidget"]'
EXCEPTION = '[data-testid="stException"]'
TIMEOUT_MS = 60_000


@contextmanager
def serving(db_url: str) -> Iterator[str]:
    """The dashboard of `db_url`, served on a free loopback port as `scaletrain ui` serves it."""
    port = free_port()
    server = subprocess.Popen(
        ui_command(port=port),
        env=ui_environment(db_url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as reply:
                    if reply.read() == b"ok":
                        break
            except OSError:
                assert server.poll() is None, "streamlit exited before serving"
                assert time.monotonic() < deadline, "streamlit did not come up in 60 s"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
def page() -> Iterator[Page]:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 700})
        finally:
            browser.close()


def settled(page: Page, selector: str, count: int = 1) -> None:
    """Wait for `count` elements matching `selector` and for Streamlit to finish running."""
    page.wait_for_function(
        f"document.querySelectorAll('{selector}').length >= {count}", timeout=TIMEOUT_MS
    )
    page.wait_for_selector(RUNNING, state="detached", timeout=TIMEOUT_MS)
    # Vega draws asynchronously after its element appears.
    page.wait_for_timeout(1000)
    assert page.locator(EXCEPTION).count() == 0, page.locator(EXCEPTION).first.inner_text()


def test_an_engineer_opens_the_overview_then_clicks_into_the_run(
    page: Page, real_run: RealRun
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with serving(real_run.db_url) as served:
        click_through(page, served, real_run)


def click_through(page: Page, served: str, real_run: RealRun) -> None:
    page.goto(served)
    settled(page, '[data-testid="stDataFrame"]')
    assert page.get_by_role("heading", name="Runs").count() == 1
    page.screenshot(path=ARTIFACTS / "ui-overview.png")
    # Tall, so that the screenshot holds the whole page (Streamlit scrolls inside itself).
    page.set_viewport_size({"width": 1400, "height": 3300})

    page.get_by_text(f"Open the health page of {real_run.run_id}").click()
    # Loss, throughput, nodes x steps, the opened node's ranks x steps, its phase breakdown and
    # straggler scores, checkpoint timeline, time use.
    settled(page, CHART, count=8)
    assert page.url == f"{served}/run?run={real_run.run_id}"
    headings = ("Loss and throughput", "Nodes", "Checkpoints", "Events and alerts",
                "Where the time went")  # fmt: skip
    for heading in headings:
        assert page.get_by_role("heading", name=heading).count() == 1, heading
    assert page.locator('[data-testid="stMetric"]').count() == 6
    assert page.locator(f"{CHART} canvas, {CHART} svg").count() >= 8
    page.screenshot(path=ARTIFACTS / "ui-run-health.png")


def test_the_page_of_a_live_run_refreshes_by_itself_when_a_step_arrives(
    page: Page, real_run: RealRun, tmp_path: Path
) -> None:
    live = tmp_path / "live.db"
    shutil.copy(real_run.db_url.removeprefix("sqlite:///"), live)
    engine = connect(f"sqlite:///{live}")
    with engine.begin() as connection:
        connection.execute(update(Run).values(status="running", finished_at=None))
    with serving(f"sqlite:///{live}") as served:
        page.goto(f"{served}/run?run={real_run.run_id}")
        settled(page, CHART)
        step = page.locator('[data-testid="stMetricValue"]').first
        assert step.inner_text() == "12"
        TelemetryStore(engine).add_steps(
            [rank_step(real_run.run_id, 13, rank, loss=4.0, times={"step": 0.1}) for rank in (0, 1)]
        )
        # No reload: the page reruns itself every REFRESH_S while the run is live.
        page.wait_for_function(
            "document.querySelector('[data-testid=\"stMetricValue\"]').innerText === '13'",
            timeout=(REFRESH_S + 20) * 1000,
        )
    engine.dispose()


CLUSTER = Cluster("cluster-512", ranks=512, steps=12)


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 512-rank run on 64 nodes, reported through the real client and service into SQLite."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cluster-ui') / 'telemetry.db'}"
    service = start(TelemetryConfig(db_url=url))
    try:
        result = simulate(service.address, CLUSTER, processes=2)
    finally:
        service.stop(grace=0)
    assert (result.records, result.dropped) == (512 * 12, 0)
    return url


def test_on_a_512_rank_run_an_engineer_searches_a_host_and_opens_its_ranks(
    page: Page, cluster_run: str
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    slow = CLUSTER.slow_node_ranks()
    host = CLUSTER.host(slow[0])
    with serving(cluster_run) as served:
        page.set_viewport_size({"width": 1400, "height": 4200})
        page.goto(f"{served}/run?run={CLUSTER.run_id}")
        # Loss, throughput, nodes x steps, the opened node's ranks, phases, scores, time use.
        settled(page, CHART, count=7)
        assert page.get_by_role("heading", name="Nodes").count() == 1
        # The view says what it samples: 48 of the 64 nodes, the slowest.
        assert page.get_by_text("48 of 64 nodes", exact=False).count() == 1
        # The slowest node is opened first: a straggler's (1.6x), then the searched host's.
        body = "document.body.innerText"
        opened = [CLUSTER.host(rank) for rank in CLUSTER.fault_plan.stragglers]
        page.wait_for_function(
            " || ".join(f"{body}.includes('Node {node}')" for node in opened), timeout=TIMEOUT_MS
        )
        settled(page, CHART, count=7)
        # Streamlit's router greets a deep link to a page with a "page not found" notice whose
        # dialog makes the page inert until it is closed (the page itself is the right one).
        if page.get_by_role("dialog").count():
            page.keyboard.press("Escape")
            page.get_by_role("dialog").wait_for(state="detached", timeout=TIMEOUT_MS)
        search = page.get_by_label("Find a rank or host")
        search.fill(host)
        search.press("Enter")
        page.wait_for_function(f"{body}.includes('Node {host}')", timeout=TIMEOUT_MS)
        settled(page, CHART, count=7)
        ranks = ", ".join(map(str, slow))
        assert page.get_by_text(f"ranks {ranks}", exact=False).count() >= 1
        page.screenshot(path=ARTIFACTS / "ui-node-view.png")
