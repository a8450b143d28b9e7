"""The playground (GET /) in a real headless Chromium against real server processes: it loads with no console
errors and fills its controls from the API, a streamed request plays from its first packet (the page's played
samples are the server's audio for that request), typed text is spoken over the WebSocket (the API key going as a
subprotocol), the key form guards a keyed server, a voice uploads and speaks on a Base model, and the embedded
tiny model (random weights) is announced as noise.

Needs Debian's chromium and chromium-driver (`.ci/run` installs them); Selenium Manager is never used: the driver
is given by path. OMNI_TTS_PLAYGROUND_SCREENSHOT=docs/playground.png saves the page after a request played.
"""
import json
import os
import shutil
import urllib.request

import pytest

from conftest import FIXTURES
from server_util import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

MODEL = "playground-model"
KEY = "playground-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLING = {"temperature": 0, "max_new_tokens": 24}  # greedy: the page's audio and a direct request's agree
FINAL_STATES = ("done", "error", "stopped")


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900",
                     "--autoplay-policy=no-user-gesture-required"):  # audio plays without a click
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def cv_server():
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--served-model-name", MODEL,
                           "--api-key", KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_server(tmp_path_factory):
    server = ServerProcess("--model", str(FIXTURES / "tiny-base"), "--served-model-name", MODEL,
                           "--voices-dir", str(tmp_path_factory.mktemp("voices")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory):
    """No --model: the embedded tiny model, generated into a cache of its own."""
    server = ServerProcess("--forced-aligner", "none", env={"OMNI_TTS_CACHE": str(tmp_path_factory.mktemp("cache"))})
    yield server
    server.stop()


def api(server: ServerProcess, path: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    headers = AUTH | ({"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(urllib.request.Request(server.url + path, data, headers), timeout=120) as response:
        return response.read()


def console_errors(driver) -> list[str]:
    """The browser's console errors since the last call (the log is read once)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def open_page(driver, server: ServerProcess, key: str | None, until_filled: bool = True) -> None:
    """The page with `key` in the tab's sessionStorage before its scripts run (as the key form leaves it), or
    none; until_filled: once it has filled its controls from the API."""
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        f"sessionStorage.clear(); if ({json.dumps(key)}) sessionStorage.setItem('omni_tts.api_key', "
        f"{json.dumps(key)});")})
    try:
        driver.get(server.url + "/")
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", script)
    if until_filled:
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))


def option_values(driver, select_id: str) -> list[str]:
    return driver.execute_script("return [...document.getElementById(arguments[0]).options].map(o => o.value)",
                                 select_id)


def set_field(driver, element_id: str, value: str) -> None:
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(value)


def set_sampling(driver) -> None:
    driver.find_element(By.CSS_SELECTOR, "details > summary").click()
    set_field(driver, "temperature", str(SAMPLING["temperature"]))
    set_field(driver, "max-new-tokens", str(SAMPLING["max_new_tokens"]))


def played_take(driver) -> dict:
    """#stats once its take is over: state, ttfp_ms, rtf, received and played samples."""
    stats = driver.find_element(By.ID, "stats")
    WebDriverWait(driver, 60).until(lambda d: stats.get_attribute("data-state") in FINAL_STATES)
    error = driver.find_element(By.ID, "error").text
    assert stats.get_attribute("data-state") == "done", error
    return {"ttfp_ms": float(stats.get_attribute("data-ttfp-ms")), "rtf": float(stats.get_attribute("data-rtf")),
            "received": int(stats.get_attribute("data-samples-received")),
            "played": int(stats.get_attribute("data-samples-played")), "mode": stats.get_attribute("data-mode")}


def test_the_page_loads_clean_and_lists_the_servers_models_voices_and_languages(browser, cv_server):
    with urllib.request.urlopen(cv_server.url + "/") as response:  # open without the key, like /docs
        policy = response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
    open_page(browser, cv_server, KEY)
    assert console_errors(browser) == []
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(r => r.name)")
    assert loaded and all(url.startswith(cv_server.url + "/") for url in loaded), loaded  # nothing from elsewhere
    models = json.loads(api(cv_server, "/v1/models"))["data"]
    voices = json.loads(api(cv_server, "/v1/audio/voices"))
    assert option_values(browser, "model") == [model["id"] for model in models]
    assert option_values(browser, "voice") == voices["voices"] + list(voices["voice_aliases"])
    assert option_values(browser, "language") == models[0]["languages"]
    assert browser.find_element(By.ID, "task-type").get_attribute("value") == "CustomVoice"
    assert not browser.find_element(By.ID, "upload-form").is_displayed()  # CustomVoice: nothing to upload
    assert not browser.find_element(By.ID, "random-weights").is_displayed()  # a checkpoint given by --model


def test_the_embedded_model_is_announced_as_noise_with_the_way_to_speech(browser, embedded_server):
    open_page(browser, embedded_server, None)
    banner = browser.find_element(By.ID, "random-weights")
    assert banner.is_displayed()
    assert "speaks noise" in banner.text and "random" in banner.text
    assert "omni-tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in banner.text
    assert console_errors(browser) == []


def test_a_streamed_request_plays_from_its_first_packet(browser, cv_server):
    open_page(browser, cv_server, KEY)
    text = "The playground plays this while it is generated."
    set_field(browser, "text", text)
    Select(browser.find_element(By.ID, "voice")).select_by_value("ryan")
    set_sampling(browser)
    browser.find_element(By.ID, "speak").click()
    take = played_take(browser)
    pcm = api(cv_server, "/v1/audio/speech", dict(SAMPLING, model=MODEL, voice="ryan", input=text,
                                                  task_type="CustomVoice", response_format="pcm", stream_format="audio"))
    assert take["mode"] == "speak" and take["received"] == len(pcm) // 2 > 0
    assert take["played"] == take["received"]  # every piece scheduled has played out
    e2e_ms = take["rtf"] * take["received"] / 24000 * 1000
    assert 0 < take["ttfp_ms"] < e2e_ms  # the first packet came (and played) before the last one
    assert console_errors(browser) == []
    if path := os.environ.get("OMNI_TTS_PLAYGROUND_SCREENSHOT"):
        browser.get_screenshot_as_file(path)


# each API's audio is /v1/audio/speech's with the same layout: a streamed HTTP answer's, or text that streams in
SAME_AS = {"elevenlabs": {"stream_format": "audio"}, "qwen_realtime": {"non_streaming_mode": False},
           "openai_realtime": {"non_streaming_mode": False}}


@pytest.mark.parametrize("protocol", SAME_AS)
def test_the_same_speech_through_each_api_the_page_can_pick(browser, cv_server, protocol):
    """The page speaks through another API as that API's browser clients do (the key as its own subprotocol or
    header); the take plays whole and equals /v1/audio/speech's audio for the same text and voice."""
    open_page(browser, cv_server, KEY)
    text = "The same words through another API."
    set_field(browser, "text", text)
    Select(browser.find_element(By.ID, "voice")).select_by_value("ryan")
    Select(browser.find_element(By.ID, "protocol")).select_by_value(protocol)
    set_sampling(browser)
    browser.find_element(By.ID, "speak").click()
    take = played_take(browser)
    pcm = api(cv_server, "/v1/audio/speech", dict(SAMPLING, model=MODEL, voice="ryan", input=text,
                                                  response_format="pcm", **SAME_AS[protocol]))
    assert take["received"] == len(pcm) // 2 > 0 and take["played"] == take["received"]
    assert console_errors(browser) == []


def test_pieces_cut_inside_a_sample_play_whole(browser, cv_server):
    """A stream's pieces may end between a sample's two bytes (fetch gives what the network cut): the player joins
    them, so it plays every sample, each once, as sent."""
    open_page(browser, cv_server, KEY)
    samples = [(i * 997) % 65536 - 32768 for i in range(101)]
    played = browser.execute_async_script("""
        const [samples, cuts, done] = arguments;
        import(location.origin + "/playground/pcm_player.js").then(async ({PcmPlayer}) => {
          const bytes = new Uint8Array(2 * samples.length);
          samples.forEach((value, i) => new DataView(bytes.buffer).setInt16(2 * i, value, true));
          const player = new PcmPlayer();
          const take = player.begin();
          cuts.slice(1).forEach((end, i) => player.push(take, bytes.subarray(cuts[i], end)));
          player.end(take);
          await take.drained;
          const values = take.samples.flatMap((piece) => [...piece].map((v) => Math.round(v * 32768)));
          done({received: take.receivedSamples, played: take.playedSamples, values});
        });""", samples, [0, 1, 1, 4, 5, 100, 201, 202])  # pieces of 1, 0, 3, 1, 95, 101 and 1 bytes
    assert played == {"received": 101, "played": 101, "values": samples}
    assert console_errors(browser) == []


def test_takes_play_one_after_another(browser, cv_server):
    """An utterance typed while the last one still speaks waits for it: a later take's audio, however early it
    arrives, starts where the earlier take's ends."""
    open_page(browser, cv_server, KEY)
    first_end, second_start = browser.execute_async_script("""
        const done = arguments[0];
        import(location.origin + "/playground/pcm_player.js").then(async ({PcmPlayer, SAMPLE_RATE}) => {
          const player = new PcmPlayer();
          const [first, second] = [player.begin(), player.begin()];
          player.push(second, new Uint8Array(480));
          player.push(first, new Uint8Array(960));
          player.end(second);
          player.push(first, new Uint8Array(960));
          player.end(first);
          await Promise.all([first.drained, second.drained]);
          done([Math.max(...first.segments.map((s) => s.start + s.length / SAMPLE_RATE)),
                Math.min(...second.segments.map((s) => s.start))]);
        });""")
    assert second_start >= first_end - 1e-6


def in_flight(server: ServerProcess) -> float:
    metrics = api(server, "/metrics").decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("omni_tts_in_flight"))


def test_stop_silences_a_request_in_flight_and_aborts_it(browser, cv_server):
    open_page(browser, cv_server, KEY)
    Select(browser.find_element(By.ID, "voice")).select_by_value("ryan")
    set_field(browser, "text", "Stopped before it ends.")
    browser.find_element(By.ID, "speak").click()  # no frame limit: it would speak for many seconds
    stats = browser.find_element(By.ID, "stats")
    WebDriverWait(browser, 30).until(lambda d: int(stats.get_attribute("data-samples-received")) > 0)
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 30).until(lambda d: stats.get_attribute("data-state") == "stopped")
    played = int(stats.get_attribute("data-samples-played"))
    assert played <= int(stats.get_attribute("data-samples-received"))
    WebDriverWait(browser, 30, 0.2).until(lambda d: in_flight(cv_server) == 0)  # the server let the request go
    assert int(stats.get_attribute("data-samples-played")) == played  # and nothing more plays
    assert browser.find_element(By.ID, "error").text == "" and console_errors(browser) == []


def test_type_to_speak_speaks_over_the_websocket_with_the_key_as_a_subprotocol(browser, cv_server):
    open_page(browser, cv_server, KEY)
    Select(browser.find_element(By.ID, "voice")).select_by_value("ryan")
    set_sampling(browser)
    browser.find_element(By.CSS_SELECTOR, "input[name=mode][value=type]").click()
    text = "Typed while it speaks."
    typed = browser.find_element(By.ID, "typed")
    typed.send_keys(text)  # one input event per key: one input.text message each
    typed.send_keys(Keys.ENTER)
    take = played_take(browser)
    # token mode speaks the whole text in the streaming layout, however it was cut (README)
    pcm = api(cv_server, "/v1/audio/speech", dict(SAMPLING, model=MODEL, voice="ryan", input=text,
                                                  response_format="pcm", non_streaming_mode=False))
    assert take["mode"] == "type" and take["received"] == len(pcm) // 2 > 0
    assert take["played"] == take["received"] and take["ttfp_ms"] > 0
    assert console_errors(browser) == []


def test_a_keyed_server_asks_for_the_key(browser, cv_server):
    open_page(browser, cv_server, None, until_filled=False)
    key_form = browser.find_element(By.ID, "key-form")
    WebDriverWait(browser, 30).until(lambda d: key_form.is_displayed())
    assert not browser.find_element(By.ID, "controls").is_displayed()
    set_field(browser, "key", "wrong-key")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    WebDriverWait(browser, 30).until(lambda d: "refused" in d.find_element(By.ID, "error").text)
    set_field(browser, "key", KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "controls").is_displayed())
    assert not key_form.is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('omni_tts.api_key')") == KEY
    # the refused requests are the only errors: a browser logs every 401 it gets
    errors = console_errors(browser)
    assert errors and all("/v1/models - Failed to load resource" in e and "401" in e for e in errors), errors


def test_a_voice_uploaded_on_a_base_model_lists_and_speaks(browser, base_server):
    open_page(browser, base_server, None)
    assert browser.find_element(By.ID, "task-type").get_attribute("value") == "Base"
    assert option_values(browser, "voice") == [""]  # "none yet": a disabled placeholder
    set_field(browser, "upload-name", "playground-voice")
    browser.find_element(By.ID, "upload-audio").send_keys(str(FIXTURES / "ref_voice.wav"))
    ref_text = (FIXTURES / "ref_voice.txt").read_text().strip()
    set_field(browser, "upload-ref-text", ref_text)
    browser.find_element(By.CSS_SELECTOR, "#upload-form button").click()
    WebDriverWait(browser, 30).until(lambda d: "uploaded" in d.find_element(By.ID, "upload-status").text)
    voices = json.loads(api(base_server, "/v1/audio/voices"))
    assert voices["voices"] == ["playground-voice"] and voices["uploaded_voices"][0]["ref_text"] == ref_text
    assert option_values(browser, "voice") == voices["voices"]
    assert browser.find_element(By.ID, "voice").get_attribute("value") == "playground-voice"
    text = "A cloned voice."
    set_field(browser, "text", text)
    set_sampling(browser)
    browser.find_element(By.ID, "speak").click()
    take = played_take(browser)
    pcm = api(base_server, "/v1/audio/speech", dict(SAMPLING, model=MODEL, voice="playground-voice", input=text,
                                                    task_type="Base", response_format="pcm", stream_format="audio"))
    assert take["received"] == len(pcm) // 2 > 0 and take["played"] == take["received"]
    assert console_errors(browser) == []
