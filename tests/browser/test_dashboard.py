"""The dashboard in a real browser: headless Chromium driven by Selenium against a real 3-node
loopback cluster (started by scripts/browser-test.sh, which passes its URL in LEASECORE_UI_URL).

It checks that the page shows the leader and the three nodes, creates a key through the editor
and sees it in the tree, grants a lease with an attached key and sees its countdown fall,
revokes it with the button and sees the attached key vanish, saves screenshots to
docs/screenshots/, and sees the page recover when the node serving it is killed and restarted. Every wait is for a condition, with a deadline (WebDriverWait).
"""
import json
import os
import subprocess
import sys
import urllib.request

import shutil

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

BASE = os.environ["LEASECORE_UI_URL"].rstrip("/")
SHOTS = os.environ.get("LEASECORE_SCREENSHOTS", "docs/screenshots")
WAIT = 20
# The page re-renders its tables as it polls: an element found may be replaced before its
# text is read. A wait then looks again at its next poll.
STALE = (StaleElementReferenceException,)


def api(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"null")


def text_of(driver, css):
    return " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, css))


def main():
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    # Name the browser and the driver explicitly: otherwise Selenium Manager goes to the
    # internet to look for them (and reports statistics). Nothing may leave loopback.
    opts.binary_location = os.environ.get("CHROMIUM_BINARY") or shutil.which("chromium")
    service = Service(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=opts, service=service)
    wait = WebDriverWait(driver, WAIT, ignored_exceptions=STALE)
    try:
        driver.get(BASE + "/ui")
        # The cluster: a leader, three nodes, healthy.
        wait.until(lambda d: d.find_element(By.ID, "leader").text.isdigit())
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")) == 3)
        wait.until(lambda d: d.find_element(By.ID, "health").text == "healthy")
        leader = driver.find_element(By.ID, "leader").text
        assert "(leader)" in text_of(driver, f'#nodes tr[data-node="{leader}"]'), "leader row not marked"

        # A key created through the editor appears in the tree.
        driver.find_element(By.ID, "key-name").send_keys("config/color")
        driver.find_element(By.ID, "key-value").send_keys("blue")
        driver.find_element(By.ID, "key-save").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#key-tree [data-key="config/color"]'))
        assert api("GET", "/v1/kv/config/color")["value"] == "blue"

        # A lease with an attached key: its countdown falls.
        api("POST", "/v1/leases", {"name": "worker-1", "ttl_ms": 60000})
        api("PUT", "/v1/kv/locks/job-42", {"value": "worker-1", "lease": "worker-1"})
        cell = '#leases tr[data-lease="worker-1"] td.countdown'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, cell))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#key-tree [data-key="locks/job-42"]'))
        # In a list: a countdown of 0.0 is still an answer.
        first = wait.until(lambda d: [float(d.find_element(By.CSS_SELECTOR, cell).text.split()[0])])[0]
        wait.until(lambda d: float(d.find_element(By.CSS_SELECTOR, cell).text.split()[0]) < first - 0.5)
        wait.until(lambda d: "locks/job-42" in text_of(d, "#events li"))
        os.makedirs(SHOTS, exist_ok=True)
        driver.save_screenshot(os.path.join(SHOTS, "dashboard.png"))

        # Revoke: the lease and its key vanish.
        # The table re-renders on every lease update, so the button found may be replaced before
        # the click lands: find it again and retry until a click is delivered.
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '[data-revoke="worker-1"]').click() or True)
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, '#leases tr[data-lease="worker-1"]'))
        wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, '#key-tree [data-key="locks/job-42"]'))
        wait.until(lambda d: "delete locks/job-42" in text_of(d, "#events li"))
        driver.save_screenshot(os.path.join(SHOTS, "dashboard-after-revoke.png"))

        # The node serving the page restarts: a banner while it is down, then back to normal.
        subprocess.run(["scripts/cluster.sh", "kill", "1"], check=True)
        wait.until(lambda d: d.find_element(By.ID, "banner").is_displayed())
        subprocess.run(["scripts/cluster.sh", "restart", "1"], check=True)
        WebDriverWait(driver, 60, ignored_exceptions=STALE).until(lambda d: not d.find_element(By.ID, "banner").is_displayed())
        WebDriverWait(driver, 60, ignored_exceptions=STALE).until(lambda d: d.find_element(By.ID, "health").text == "healthy")
        print("dashboard browser test: ok")
    except Exception:
        os.makedirs(SHOTS, exist_ok=True)
        driver.save_screenshot(os.path.join(SHOTS, "dashboard-failure.png"))
        raise
    finally:
        driver.quit()


if __name__ == "__main__":
    sys.exit(main())
