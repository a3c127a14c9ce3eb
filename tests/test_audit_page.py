"""The audit page as a person sees it: a real sidecar, real deletions, a real headless Chromium.

One sidecar (SISA learner, SQLite ledger) serves the whole module: deletions by record id
and by subject go in over HTTP, a worker applies and verifies them, predictions leave guard
usage behind; then Selenium drives Debian's chromium through the page. The screenshot lands
in test-artifacts/audit-page.png. Chromium and chromedriver come from Debian
(`make .venv/.browser`); Selenium never downloads a browser or driver here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.sidecar import REPO, Sidecar

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = REPO / "test-artifacts"
WRONG_TOKEN = "not-the-admin-token"

# Requests the page is checked against. del-subj is sent once del-rec-1 is applied:
# a subject deletion covers the subject's records that are not purged yet.
BY_RECORD = [{"request_id": "del-rec-1", "op": "delete", "record_ids": ["r015"]},
             {"request_id": "del-rec-2", "op": "delete", "record_ids": ["r030", "r031"]}]
BY_SUBJECT = {"request_id": "del-subj", "op": "delete", "subject_id": "s005"}
REJECTED = {"request_id": "bad-1", "op": "delete", "record_ids": ["no-such-record"]}
ALL = ["del-rec-1", "del-rec-2", "del-subj"]
STATE: dict[str, str] = {}  # what the module's sidecar fixture found out

pytestmark = [pytest.mark.processes, pytest.mark.skipif(  # a browser and the sidecar
    not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
           "run `make .venv/.browser`")]


def _queries() -> list[list[float]]:
    from ledger.datasets import load

    X = load("breast_cancer").X
    rng = np.random.default_rng(1)
    return np.vstack([X[::12], rng.random((20, X.shape[1]))]).tolist()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    sc = Sidecar(tmp_path_factory.mktemp("audit-sidecar"), learner="sisa")
    try:
        sc.start(workers=1)
        queries = _queries()
        assert sc.predict(queries)["model_version"] == "v000001"
        for req in BY_RECORD:
            assert sc.submit(req).status_code == 202, req
        rejected = sc.submit(REJECTED)
        assert rejected.status_code == 422 and rejected.json()["status"] == "rejected"
        sc.wait_for_status(["del-rec-1"], "applied", timeout_s=90)  # r015 is purged
        assert sc.submit(BY_SUBJECT).status_code == 202
        sc.wait_for_status(ALL, "verified", timeout_s=90)
        # Guard usage of the newest version too (test_usage waits for its flush, ~5 s).
        latest = sc.models()["current"]["version"]
        sc.wait_until(lambda: sc.predict(queries)["model_version"] == latest, 30,
                      f"the server to serve {latest}")
        STATE["latest"] = latest
        yield sc
    finally:
        sc.close()


@pytest.fixture(scope="module")
def browser(sidecar: Sidecar) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(flag)
    service = Service(executable_path=CHROMEDRIVER,
                      log_output=str(sidecar.log_dir / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, condition, what: str, timeout_s: float = 15.0):  # noqa: ANN001
    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(
            lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}; it shows:\n"
                             f"{driver.find_element(By.TAG_NAME, 'body').text}") from None


def text_of(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def use_token(driver: WebDriver, token: str) -> None:
    box = driver.find_element(By.ID, "token-input")
    box.clear()
    box.send_keys(token)
    driver.find_element(By.ID, "token-save").click()


def admin(driver: WebDriver, sidecar: Sidecar) -> None:
    """Enter the right token (each test can run alone) and wait for the page to accept it."""
    use_token(driver, sidecar.admin_token)
    wait_for(driver, lambda d: text_of(d, "token-status") == "token accepted", "token accepted")


def search(driver: WebDriver, query: str) -> None:
    box = driver.find_element(By.ID, "search-input")
    box.clear()
    box.send_keys(query)
    driver.find_element(By.ID, "search-button").click()


def refresh(driver: WebDriver, button: str, table: str) -> None:
    """Click a section's Refresh button and wait until its table is drawn anew."""
    before = int(driver.find_element(By.ID, table).get_attribute("data-loads") or 0)
    driver.find_element(By.ID, button).click()
    wait_for(driver, lambda d: int(d.find_element(By.ID, table).get_attribute("data-loads")
                                   or 0) > before, f"{table} reloaded")


def cells(row: WebElement) -> dict[str, str]:
    return {c.get_attribute("data-field"): c.text
            for c in row.find_elements(By.CSS_SELECTOR, "td[data-field]")}


@pytest.fixture(scope="module")
def page(sidecar: Sidecar, browser: WebDriver) -> WebDriver:
    browser.get(sidecar.url + "/audit")
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#lineage-table tbody tr"),
             "the model lineage")
    return browser


def test_without_token_the_page_asks_for_it(page: WebDriver) -> None:
    page.find_element(By.ID, "token-clear").click()
    wait_for(page, lambda d: "Enter the admin token" in text_of(d, "usage-message"),
             "a request for the token in the usage section")
    search(page, "del-rec-1")
    wait_for(page, lambda d: "Enter the admin token" in text_of(d, "search-message"),
             "a request for the token")
    assert not page.find_element(By.ID, "request-section").is_displayed()
    # the lineage is public
    assert page.find_elements(By.CSS_SELECTOR, "#lineage-table tbody tr")


def test_wrong_token_shows_an_error(page: WebDriver) -> None:
    use_token(page, WRONG_TOKEN)
    wait_for(page, lambda d: "refused" in text_of(d, "token-status"), "the token refused")
    search(page, "del-rec-1")
    wait_for(page, lambda d: "403" in text_of(d, "search-message"), "a 403 message")
    assert "refused" in text_of(page, "search-message")
    assert not page.find_element(By.ID, "request-section").is_displayed()
    wait_for(page, lambda d: "refused" in text_of(d, "usage-message"),
             "the usage section's 403 message")


def test_request_timeline(sidecar: Sidecar, page: WebDriver) -> None:
    admin(page, sidecar)
    search(page, "del-rec-1")
    wait_for(page, lambda d: d.find_element(By.ID, "request-section").is_displayed()
             and text_of(d, "request-id") == "del-rec-1", "request del-rec-1")
    assert text_of(page, "request-status").lower() == "verified"

    history = sidecar.history("del-rec-1")
    versions = {e["kind"]: e["model_version"] for e in history["events"]}
    steps = page.find_elements(By.CSS_SELECTOR, "#lifecycle li")
    assert [s.get_attribute("data-step") for s in steps] == [
        "received", "claimed", "applied", "verified"]
    assert all("done" in s.get_attribute("class") for s in steps)
    step = {s.get_attribute("data-step"): s.text for s in steps}
    assert versions["applied"] and versions["verified"]
    assert f"model {versions['applied']}" in step["applied"]
    assert f"model {versions['verified']}" in step["verified"]

    rows = page.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    assert [r.get_attribute("data-kind") for r in rows] == [e["kind"] for e in history["events"]]
    # every event's inclusion proof is checked in the browser against the tree head
    wait_for(page, lambda d: all(
        c.get_attribute("data-valid") == "true"
        for c in d.find_elements(By.CSS_SELECTOR, "#timeline td[data-field=proof]")),
        "every inclusion proof verified")
    for row, event in zip(rows, history["events"], strict=True):
        c = cells(row)
        assert c["kind"] == event["kind"]
        assert c["version"] == (event["model_version"] or "—")
        assert c["hash"] == event["hash"][:12] + "…"
        assert "included in tree head" in c["proof"]
    assert "exactness checked" in cells(rows[-1])["detail"]
    assert "Tree head:" in text_of(page, "tree-head")

    # what the deletion removed: the record, when, the versions that held it
    wait_for(page, lambda d: d.find_element(By.ID, "forgotten").is_displayed(),
             "what the deletion removed")
    [rec] = page.find_elements(By.CSS_SELECTOR, "[data-testid=forgotten-record]")
    assert rec.text.startswith("r015") and "still held" not in rec.text
    assert f"published without it: {versions['applied']}" in text_of(page, "forgotten-first")
    held = page.find_elements(By.CSS_SELECTOR, "[data-testid=held-by]")
    assert held and held[0].text.startswith("v000001")
    assert "hash matches" in text_of(page, "forgotten-exactness")


def test_rejected_request_shows_its_reason(sidecar: Sidecar, page: WebDriver) -> None:
    admin(page, sidecar)
    search(page, "bad-1")
    wait_for(page, lambda d: text_of(d, "request-id") == "bad-1"
             and d.find_element(By.ID, "request-reason").is_displayed(), "the rejection")
    assert text_of(page, "request-status").lower() == "rejected"
    assert "unknown record" in text_of(page, "request-reason")


def test_subject_lists_its_requests(sidecar: Sidecar, page: WebDriver) -> None:
    admin(page, sidecar)
    search(page, "s005")
    wait_for(page, lambda d: d.find_element(By.ID, "subject-section").is_displayed(),
             "the subject's requests")
    assert text_of(page, "subject-id") == "s005"
    rows = page.find_elements(By.CSS_SELECTOR, "#subject-requests tbody tr")
    expected = [r["request_id"] for r in sidecar.subject_requests("s005")]
    assert [r.get_attribute("data-request-id") for r in rows] == expected
    assert set(expected) == {"del-rec-1", "del-subj"}
    assert all("verified" in r.text.lower() for r in rows)
    rows[-1].find_element(By.TAG_NAME, "a").click()
    wait_for(page, lambda d: text_of(d, "request-id") == "del-subj", "request del-subj")
    assert "s005" in page.find_element(By.CSS_SELECTOR, "[data-field=subject]").text
    assert page.find_element(By.ID, "subject-section").is_displayed()


def test_unknown_id_says_nothing_found(sidecar: Sidecar, page: WebDriver) -> None:
    admin(page, sidecar)
    search(page, "nobody-at-all")
    wait_for(page, lambda d: "Nothing found" in text_of(d, "search-message"), "nothing found")


def test_lineage_lists_every_version(sidecar: Sidecar, page: WebDriver) -> None:
    refresh(page, "lineage-refresh", "lineage-table")
    lineage = sidecar.lineage()  # the worker is idle: nothing is published any more
    rows = page.find_elements(By.CSS_SELECTOR, "#lineage-table tbody tr")
    assert len(lineage) >= 3  # train, at least one update, at least one guard refit
    for row, v in zip(rows, lineage, strict=True):
        c, m = cells(row), v["manifest"]
        assert row.get_attribute("data-version") == v["version"]
        assert c["version"].startswith(v["version"])
        assert c["parent"] == (v["parent"] or "—")
        assert c["op"].startswith(m["change"]["op"].replace("guard", "guard refit"))
        assert c["learner"] == "sisa" and c["guarantee"] == m["guarantee"]
        assert c["guard"].startswith("ready" if m["guard"]["ready"] else "noise-all")
        assert c["count"] == str(m["training_set"]["count"])
        assert c["merkle-root"] == m["training_set"]["merkle_root"][:12] + "…"
    assert "current" in rows[0].text
    # the training set shrank by the deleted records: r015, r030, r031, then r016, r017
    assert cells(rows[0])["count"] == str(569 - 5)


def test_usage_shows_counts_and_chart(sidecar: Sidecar, page: WebDriver) -> None:
    # each serving process writes its counts every ~5 s (and when it swaps versions)
    latest = STATE["latest"]
    sidecar.wait_until(lambda: any(v["version"] == latest and v["certain"] + v["noised"]
                                   for v in sidecar.usage()["versions"]), 30,
                       f"guard usage of {latest} to be written")
    admin(page, sidecar)
    refresh(page, "usage-refresh", "usage-table")
    # no predictions run any more, so the page and the API agree
    usage = sidecar.usage(10)
    total = page.find_element(By.ID, "usage-total")
    certain = int(total.get_attribute("data-certain"))
    noised = int(total.get_attribute("data-noised"))
    assert certain + noised > 0
    assert (certain, noised) == (sum(v["certain"] for v in usage["versions"]),
                                 sum(v["noised"] for v in usage["versions"]))
    rows = page.find_elements(By.CSS_SELECTOR, "#usage-table tbody tr")
    assert [r.get_attribute("data-version") for r in rows] == [
        v["version"] for v in usage["versions"]]
    for row, v in zip(rows, usage["versions"], strict=True):
        c = cells(row)
        assert (c["certain"], c["noised"]) == (str(v["certain"]), str(v["noised"]))
    assert page.find_elements(By.CSS_SELECTOR, "#usage-chart svg rect.certain, "
                                               "#usage-chart svg rect.noised")
    assert "ε spent in total" in total.text


def test_screenshot(sidecar: Sidecar, page: WebDriver) -> None:
    """Last: the whole page with a request open, for a person to look at."""
    admin(page, sidecar)
    search(page, "del-subj")
    wait_for(page, lambda d: text_of(d, "request-id") == "del-subj" and all(
        c.get_attribute("data-valid") == "true"
        for c in d.find_elements(By.CSS_SELECTOR, "#timeline td[data-field=proof]")),
        "request del-subj")

    def as_high_as_the_page(d: WebDriver) -> bool:
        """Resize the window to the page; True once it fits (the height changes once the
        width does)."""
        height = min(int(d.execute_script("return document.documentElement.scrollHeight"))
                     + 140, 5000)
        if d.get_window_size() == {"width": 1280, "height": height}:
            return True
        d.set_window_size(1280, height)
        return False
    wait_for(page, as_high_as_the_page, "a window as high as the page")
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / "audit-page.png"
    assert page.save_screenshot(str(out))
    assert out.stat().st_size > 10_000
