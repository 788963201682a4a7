"""The demo served for real: headless Chromium (the distribution's ``chromium`` and ``chromedriver``, never a
downloaded browser) types a prompt, clicks, and reads both images, the stats and the verdict; two requests at once are
both answered; a bad request gets its message and the server keeps serving.

CI installs Chromium (``.ci/run``); where it or Gradio is missing these tests fail and say what to install.
``SPATIAL_DEMO_SCREENSHOT=PATH`` also saves the page's screenshot there (the docs' picture, made with
``SPATIAL_DEMO_MODEL=embedded``: the embedded model and its heads instead of a tiny random one)."""

import importlib
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spatial_pipelines import demo

from helpers import tiny_pipeline_with_every_heads

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"


def _require(module: str, how: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"the demo's browser tests need {module}: {how}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load():
    """The pipeline and heads the app serves: the tiny random model (fast), or the embedded one."""
    if os.environ.get("SPATIAL_DEMO_MODEL") == "embedded":
        from spatial_pipelines.embedded import load_default_pipeline

        pipe = load_default_pipeline()
        return pipe, demo.load_heads(pipe, embedded=True), "the embedded Twemoji model"
    return (*tiny_pipeline_with_every_heads(), "a tiny random LlamaGen model")


@pytest.fixture(scope="module")
def server():
    """The app on a free local port, for the module's tests; closed after them."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    _require("gradio", 'pip install -e ".[test]" (or ".[demo]")')
    pipe, heads, name = _load()
    app = demo.build_app(pipe, heads, max_images=3, max_queue=4, model_name=name)
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.close()


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven through the distribution's chromedriver."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(os.path.basename(path))):
            pytest.fail(f"the demo's browser tests need {path}: {INSTALL}")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager never downloads a browser or a driver
    webdriver = _require("selenium.webdriver", 'pip install -e ".[test]"')
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1100"):
        options.add_argument(flag)
    driver_path = CHROMEDRIVER if os.path.exists(CHROMEDRIVER) else shutil.which("chromedriver")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(condition, timeout: float = 60, what: str = ""):
    """Poll ``condition()`` until it returns something true; fail after ``timeout`` seconds naming ``what``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = condition()
        except Exception:  # the page is still being built
            value = None
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"the page did not show {what} within {timeout} s")


def _text(driver, elem_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, elem_id).text


def _image_loaded(driver, elem_id: str) -> bool:
    from selenium.webdriver.common.by import By

    images = driver.find_elements(By.CSS_SELECTOR, f"#{elem_id} img")
    return any(driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", i) for i in images)


def test_the_page_shows_both_images_the_stats_and_the_verdict(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server)
    prompt = _wait(lambda: browser.find_element(By.CSS_SELECTOR, "#prompt textarea"), what="the prompt box")
    prompt.send_keys("red heart")
    browser.find_element(By.ID, "generate").click()
    verdict = _wait(lambda: _text(browser, "verdict"), what="the verdict")
    assert "Identical: the sjd images equal AR's pixel for pixel" in verdict
    for elem_id in ("ar-image", "decoder-image", "acceptance"):
        _wait(lambda: _image_loaded(browser, elem_id), what=f"the image #{elem_id}")
    stats = _text(browser, "stats")
    assert "codes per pass" in stats and "speed-up" in stats and "sjd" in stats
    browser.save_screenshot(str(tmp_path / "demo.png"))
    assert (tmp_path / "demo.png").stat().st_size > 0
    if os.environ.get("SPATIAL_DEMO_SCREENSHOT"):
        browser.save_screenshot(os.environ["SPATIAL_DEMO_SCREENSHOT"])

    from selenium.webdriver.common.keys import Keys

    prompt.send_keys(Keys.CONTROL, "a")  # a bad request (the prompt emptied as a user would): its message on the page
    prompt.send_keys(Keys.BACKSPACE)
    browser.find_element(By.ID, "generate").click()
    _wait(lambda: "prompt is empty" in browser.find_element(By.TAG_NAME, "body").text.replace("`", ""),
          timeout=30, what="the empty-prompt message")


def test_two_requests_at_once_are_both_answered(server):
    from gradio_client import Client

    client = Client(server, verbose=False)
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(client.predict, "fox", "sjd", seed, 1, api_name="/compare") for seed in (1, 2)]
        results = [job.result(timeout=120) for job in jobs]
    for result in results:
        assert len(result) == 5 and all(os.path.isfile(path) for path in result[:3])
        assert result[4].startswith("Identical")


def test_a_bad_request_leaves_the_server_up(server):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(server, verbose=False)
    # the slider's bound is checked by Gradio itself on the API, ours on the page
    for args, message in ((("", "sjd", 0, 1), "`prompt` is empty"),
                          (("fox", "sjd", 0, 99), r"(`images per prompt` must be an int in \[1, 3\]|maximum value 3)"),
                          (("fox", "nope", 0, 1), "(`decoder` must be one of|not in the list of choices)")):
        with pytest.raises(AppError, match=message):
            client.predict(*args, api_name="/compare")
    result = client.predict("fox", "ssd", 0, 2, api_name="/compare")
    assert "Different: ssd (lossy)" in result[4] or "lossy decoder does not promise" in result[4]
