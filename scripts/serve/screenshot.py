#!/usr/bin/env python3
"""Opens the chat page of a running `rloo serve` in headless Chromium,
sends one prompt in side-by-side mode and saves a screenshot once both
answers (and their reward-model scores, when a reward model is served)
are in. Outside CI: needs `pip install selenium` and Chromium with its
driver (`apt-get install chromium chromium-driver`).

    python3 scripts/serve/screenshot.py http://127.0.0.1:8000 sft rloo "Review: Casablanca" serve.png
"""

import sys
import time

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

url, model_a, model_b, prompt, out = sys.argv[1:6]
options = webdriver.ChromeOptions()
for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,860"]:
    options.add_argument(arg)
driver = webdriver.Chrome(options=options)
try:
    driver.get(url)
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#model-a option")) > 0)
    driver.find_element(By.ID, "tab-compare").click()
    Select(driver.find_element(By.ID, "model-a")).select_by_visible_text(model_a)
    Select(driver.find_element(By.ID, "model-b")).select_by_visible_text(model_b)
    rewards = driver.find_elements(By.CSS_SELECTOR, "#reward option")
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(prompt)
    driver.find_element(By.ID, "send").click()

    def answered(d):
        errors = [e.text for e in d.find_elements(By.CSS_SELECTOR, ".msg.error")]
        if errors:
            raise SystemExit(f"the page shows an error: {errors}")
        metas = [m.text for m in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")]
        done = len(metas) == 2 and all("tokens" in m for m in metas)
        return done and (not rewards or all("score" in m for m in metas))

    wait.until(answered)
    time.sleep(0.3)
    driver.save_screenshot(out)
    for side in ["a", "b"]:
        answer = driver.find_element(By.CSS_SELECTOR, f"#log-{side} .msg.assistant")
        print(f"{side}: {answer.text!r}")
    print(f"saved {out}")
finally:
    driver.quit()
