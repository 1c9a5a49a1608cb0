"""The fleet dashboard in a real headless browser (Debian's Chromium through Selenium), and
`sloserve top` in a real terminal (tmux).

A live single server on the embedded model under load from the official `openai` client: the
page loads without console errors, draws its charts, and once the load ends shows the numbers
`/metrics` exports (finished and SLO-met requests per class, running and waiting). A
multi-instance front (stand-in workers): one row per instance, an operator's drain in the event
log, and the data behind the admin key. A simulated run's report.html: frames, a working time
slider. Screenshots go to test-artifacts/ (ignored by git) for a person to look at.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from server_helpers import ROOT, ServerProcess, metric, scrape, wait_for

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail("the dashboard tests need Chromium and its driver: `make test` installs the Debian packages "
                    "chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1600",
                "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser):
    """The shared browser on a blank page, its console log emptied: what a test sees is its own."""
    browser.get("about:blank")
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")  # stop the last page's polling


def console_errors(driver, expected: tuple[str, ...] = ()) -> list:
    """Errors the page logged, but those the test caused on purpose (`expected` substrings)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
            and not any(text in e["message"] for text in expected)]


def cell(driver, row_selector: str, field: str) -> str:
    """A table cell's text, read in one script call (the page rebuilds its tables on every poll,
    so an element found first and read after may be gone); "" when there is no such cell."""
    return driver.execute_script("const c = document.querySelector(arguments[0]); return c ? c.textContent : ''",
                                 f'{row_selector} td[data-field="{field}"]')


def texts(driver, selector: str) -> list[str]:
    """The text of every element matching `selector`, read in one script call (see `cell`)."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)",
                                 selector)


def drawn_series(driver) -> int:
    return len(texts(driver, "svg.chart path.series"))


# ------------------------------------------------------------------ a live server under load


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--dashboard-interval", "0.5", "--max-num-seqs", "4"],
                        tmp_path_factory.mktemp("dash") / "server.log")
    try:
        yield srv
    finally:
        srv.kill()


def load(srv: ServerProcess, n: int, concurrency: int) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(i: int) -> int:
        stream = client.chat.completions.create(model=model, stream=True, max_tokens=48,
                                                messages=[{"role": "user", "content": f"Count to {i + 3}."}])
        return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.slow
def test_the_live_page_draws_the_server_under_load_and_matches_its_metrics(page, server):
    browser = page
    running = threading.Thread(target=load, args=(server, 16, 4))
    running.start()
    try:
        browser.get(server.base_url + "/dashboard")
        wait_for(lambda: int(browser.find_element("tag name", "body").get_attribute("data-frames") or 0) >= 3, 30,
                 what="the page to have 3 frames")
        wait_for(lambda: drawn_series(browser) >= 3, 20, what="charts drawn")
        busy = wait_for(lambda: int(cell(browser, 'tr[data-instance="0"]', "running") or 0), 30,
                        what="the page to show a running request")
        assert busy >= 1
        browser.save_screenshot(str(ARTIFACTS / "dashboard-live-under-load.png"))
    finally:
        running.join(180)
    assert not running.is_alive()

    def settled() -> bool:  # the page caught up with the idle server
        samples = scrape(server.base_url)
        done = metric(samples, "sloserve:slo_requests_total", qos_class="default")
        met = metric(samples, "sloserve:slo_attained_requests_total", qos_class="default")
        row = 'tr[data-qos-class="default"]'
        return done == 16 and cell(browser, row, "finished") == str(int(done)) \
            and cell(browser, row, "attained") == str(int(met)) \
            and cell(browser, 'tr[data-instance="0"]', "running") == str(int(
                metric(samples, "sloserve:num_requests_running"))) \
            and cell(browser, 'tr[data-instance="0"]', "waiting") == str(int(
                metric(samples, "sloserve:num_requests_waiting")))

    wait_for(settled, 20, interval=0.5, what="the page's numbers to match /metrics")
    assert float(cell(browser, 'tr[data-qos-class="default"]', "ttft_p50")) > 0
    assert console_errors(browser) == []
    browser.save_screenshot(str(ARTIFACTS / "dashboard-live-idle.png"))


@pytest.mark.slow
def test_sloserve_top_renders_under_tmux(server):
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.fail("tmux is needed (Debian package tmux)")
    session = f"sloserve-top-{server.port}"
    cmd = f"{sys.executable} -m sloserve.cli top --url {server.base_url} --interval 0.5"
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd], check=True, cwd=ROOT)
    try:
        def screen() -> str:
            return subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

        text = wait_for(lambda: (s := screen()) and "ready" in s and "default" in s and s, 30,
                        what="top to show the instance and class rows")
        rows = [line for line in text.splitlines() if "mixed" in line]
        assert len(rows) == 1 and "ready" in rows[0]  # instance 0's row
        (ARTIFACTS / "top.txt").parent.mkdir(exist_ok=True)
        (ARTIFACTS / "top.txt").write_text(text)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)


# ------------------------------------------------------------------ a multi-instance front


class FrontThread:
    """A front over stand-in workers, served from a thread (the browser test is synchronous)."""

    def __init__(self, num: int, admin_key: str) -> None:
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.url = ""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(num, admin_key), daemon=True)
        self.thread.start()
        if not self.ready.wait(60):
            raise TimeoutError("front did not start")
        if self.error is not None:
            raise self.error

    def _run(self, num: int, admin_key: str) -> None:
        try:
            asyncio.run(self._main(num, admin_key))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e
            self.ready.set()

    async def _main(self, num: int, admin_key: str) -> None:
        from fleet_helpers import front_config
        from multi_helpers import FakeWorker, serving_front

        cfg = front_config(instances=num, router="round-robin", poll_interval_s=0.1, admin_keys=(admin_key,),
                           timeline_interval_s=0.5)
        async with serving_front(lambda slot: FakeWorker(5, 0.02), cfg, run_loops=True) as (_, _, port):
            self.url = f"http://127.0.0.1:{port}"
            self.ready.set()
            while not self.stop.is_set():
                await asyncio.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def test_the_front_page_shows_every_instance_its_events_and_keeps_data_behind_the_admin_key(page):
    browser = page
    front = FrontThread(3, admin_key="adm-1")
    try:
        admin = {"Authorization": "Bearer adm-1"}
        assert httpx.get(front.url + "/dashboard").status_code == 200  # the page holds no data: public
        assert httpx.get(front.url + "/dashboard/data").status_code == 401
        assert httpx.get(front.url + "/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 403
        assert httpx.get(front.url + "/dashboard/data?since=soon", headers=admin).json()["error"]["param"] == "since"
        for i in range(6):
            r = httpx.post(front.url + "/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 5}, timeout=30)
            assert r.status_code == 200
        assert httpx.post(front.url + "/v1/instances/2/drain", headers=admin).status_code == 200

        browser.get(front.url + "/dashboard")
        from selenium.webdriver.common.by import By

        wait_for(lambda: browser.find_element(By.ID, "key-row").is_displayed(), 10, what="the key prompt")
        browser.find_element(By.ID, "key").send_keys("adm-1")
        browser.find_element(By.ID, "key-go").click()
        wait_for(lambda: len(texts(browser, "#instances tbody tr")) == 3, 15,
                 what="three instance rows")
        wait_for(lambda: cell(browser, 'tr[data-instance="2"]', "status") == "draining", 10, what="the drain shown")
        drains = texts(browser, '#events tr[data-kind="drain"]')
        assert len(drains) == 1 and "operator" in drains[0]
        samples = httpx.get(front.url + "/metrics", headers=admin).text
        assert 'sloserve:slo_requests_total{qos_class="default"} 6.0' in samples
        wait_for(lambda: cell(browser, 'tr[data-qos-class="default"]', "finished") == "6", 10,
                 what="the page's count to match /metrics")
        assert drawn_series(browser) >= 3
        assert console_errors(browser, expected=("status of 401",)) == []  # the first poll, before the key
        browser.save_screenshot(str(ARTIFACTS / "dashboard-front.png"))

        # `sloserve top --once`: without the key a one-line reason and exit 1; with it, the fleet.
        top = [sys.executable, "-m", "sloserve.cli", "top", "--url", front.url, "--once"]
        refused = subprocess.run(top, capture_output=True, text=True, timeout=60, cwd=ROOT,
                                 env={**os.environ, "COLUMNS": "120", "SLOSERVE_ADMIN_KEY": "", "SLOSERVE_API_KEY": ""})
        assert refused.returncode == 1 and "needs a key" in refused.stdout and len(refused.stdout.splitlines()) <= 2
        shown = subprocess.run(top + ["--key", "adm-1"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                               env={**os.environ, "COLUMNS": "120"})
        assert shown.returncode == 0, shown.stderr
        rows = [line for line in shown.stdout.splitlines() if line.startswith("│") and "mixed" in line]
        assert len(rows) == 3 and "draining" in rows[2] and "default" in shown.stdout
    finally:
        front.close()


# ------------------------------------------------------------------ a simulated run's report


def test_a_simulated_runs_report_draws_and_its_slider_walks_the_run(page, tmp_path):
    browser = page
    out = tmp_path / "sim"
    res = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "simulate", "--workload", "azure-conv", "--replay", "--duration", "120",
         "--instances", "1:4", "--autoscale", "reactive", "--capacity", "1", "--cold-start", "20",
         "--scaling-interval", "10", "--hardware", "a10-24g", "--model", "llama-2-7b", "--timeline-interval", "2",
         "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    from selenium.webdriver.common.by import By

    page = (out / "report.html").read_text()
    start = page.index('id="timeline-data">') + len('id="timeline-data">')
    recorded = json.loads(page[start:page.index("</script>", start)])["frames"]
    ready = [sum(i["status"] == "ready" for i in f["instances"]) for f in recorded]
    assert ready[0] == 1 and max(ready) > 1  # the autoscaler added instances

    browser.get(Path(out / "report.html").as_uri())
    assert int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-frames")) == len(recorded) >= 60
    assert drawn_series(browser) >= 3
    assert browser.find_elements(By.CSS_SELECTOR, '#events tr[data-kind="start"]')
    slider = browser.find_element(By.ID, "slider")

    def shown_ready(frame: int) -> int:
        browser.execute_script("arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'))",
                               slider, frame)
        assert f"frame {frame + 1} of {len(recorded)}" in browser.find_element(By.ID, "slider-time").text
        return len(browser.find_elements(By.XPATH, '//td[@data-field="status" and text()="ready"]'))

    busiest = ready.index(max(ready))
    assert shown_ready(0) == 1 and shown_ready(busiest) == max(ready)
    # The events listed stop at the slider's time: none after the first frame but those at 0.
    shown_ready(0)
    assert not browser.find_elements(By.CSS_SELECTOR, '#events tr[data-kind="ready"]')
    assert console_errors(browser) == []
    browser.save_screenshot(str(ARTIFACTS / "report-first-frame.png"))
