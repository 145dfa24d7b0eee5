"""The web pages (the chat page at / and the dashboard at /dashboard) in a real headless Chromium, driven by Selenium,
against real `basert serve` processes: SmolLM2 without a key, SmolLM2 with --api-key, and one with --no-webui.

The tests run in file order and share the browser and the servers: the chat tests build on the conversations the
earlier ones left (a reload must find them), and the dashboard reads the counters they moved. Chromium and its driver
come from the system (Debian's `chromium` and `chromium-driver`); Selenium is told where they are, so it never
downloads a browser or a driver. Screenshots of both pages are left in the module's tmp folder.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from basert.testing.client import answer, error_envelope, post
from basert.testing.launcher import ServerProcess, start_servers, stop_servers

pytestmark = pytest.mark.browser   # run with -m browser (CI's browser stage), not in the default run

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("the web UI tests need Chromium and its driver (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="the web UI tests need selenium (the `test` extra)")

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

MODEL = "smollm2"           # the id of tests' smollm2.base
API_KEY = "webui-test-key"
PAGE_WEIGHT_LIMIT = 300_000
# What a browser asks for when it opens a page.
BROWSER_ACCEPT = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
GREEDY = {"temperature": 0, "seed": 7}
STORY = "Write a short story about a cat who learns to sail."
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# Model output that would run as markup if a renderer let it through.
HOSTILE = ("Here is <b>bold</b> markup <script>window.__pwned = 'script'</script> and\n"
           "<img src=x onerror=\"window.__pwned = 'img'\">\n\n"
           "[click me](javascript:window.__pwned='link') and [a real link](https://example.com/docs)")
# A long shared system prompt (about 300 tokens) for the dashboard's concurrent requests.
SHARED_PREFIX = "You are a careful assistant for a shipping company. " + " ".join(
    f"Rule {i}: answer politely, state the port, the vessel and the cargo, and never guess a date." for i in range(24))


@pytest.fixture(scope="module")
def servers(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    """(plain, keyed, without pages): SmolLM2 with --max-context 1024 and an empty models directory. The plain one
    keeps slot snapshots in its files store (--files-dir) and listens on every interface, so that a client on this
    machine's own network address is a client beyond loopback; the keyed one keeps them by file name
    (--slot-save-path)."""
    root = tmp_path_factory.mktemp("webui-servers")
    env = {"BASERT_MODELS_DIR": str(root / "models")}
    common = (smollm2_base, "--max-context", "1024")
    started = start_servers(
        lambda: ServerProcess(*common, "--files-dir", str(root / "files"), "--host", "0.0.0.0",
                              log_path=root / "plain.log", env=env),
        lambda: ServerProcess(*common, "--api-key", API_KEY, "--slot-save-path", str(root / "slots"),
                              log_path=root / "keyed.log", env=env),
        lambda: ServerProcess(*common, "--no-webui", log_path=root / "no-webui.log", env=env),
    )
    yield started
    codes = stop_servers(*started)
    assert codes == [0, 0, 0], [server.log_text()[-3000:] for server in started]


@pytest.fixture(scope="module")
def plain(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("webui-screenshots")


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1200",
                     "--disable-background-networking", "--disable-component-update", "--no-first-run"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    # No script failed on any page (refused requests, 401s among them, are logged as failed loads: expected).
    errors = [e["message"] for e in driver.get_log("browser") if "Failed to load resource" not in e["message"]]
    driver.quit()
    assert not errors, errors


# --- helpers --------------------------------------------------------------------------------------------------


def wait_for(driver, condition: Callable, timeout: float = 30, message: str = ""):
    """WebDriverWait(...).until(condition), polling every 50 ms."""
    return WebDriverWait(driver, timeout, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException,)).until(condition, message)


def open_chat(driver, url: str) -> None:
    driver.get(url + "/")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), message="the model list")


def set_field(driver, field_id: str, value: str) -> None:
    """Set a settings field as typing would (the page saves its settings on change)."""
    driver.execute_script("const field = document.getElementById(arguments[0]); field.value = arguments[1];"
                          "field.dispatchEvent(new Event('change'));", field_id, value)


def send_message(driver, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def idle(driver) -> bool:
    return driver.find_element(By.ID, "send").is_enabled() and not driver.find_elements(By.CSS_SELECTOR, ".streaming")


def wait_idle(driver, timeout: float = 60) -> None:
    wait_for(driver, idle, timeout, "the reply to end")


def last_reply_text(driver) -> str:
    return driver.execute_script(
        "const replies = document.querySelectorAll('.msg.assistant .content');"
        "return replies.length ? replies[replies.length - 1].textContent : null;")


def stored_conversations(driver) -> list[dict]:
    return driver.execute_script("return JSON.parse(localStorage.getItem('basert.chat.conversations') || '[]')")


def current_messages(driver) -> list[dict]:
    """The shown conversation as the page stores it."""
    active = driver.find_element(By.CSS_SELECTOR, ".conversation.active").get_attribute("data-id")
    return next(c for c in stored_conversations(driver) if c["id"] == active)["messages"]


def new_chat(driver) -> None:
    driver.find_element(By.ID, "new-chat").click()
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#transcript .empty"))


def slots_busy(url: str, headers: dict | None = None) -> list[bool]:
    return [slot["is_processing"] for slot in answer(httpx.get(url + "/slots", headers=headers, timeout=30))]


class AssetLinks(HTMLParser):
    """What a page loads: the src and href of its scripts, style sheets, icons and images."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("script", "link", "img"):
            self.links += [value for name, value in attrs if name in ("src", "href") and value]


# --- tests ----------------------------------------------------------------------------------------------------


def test_pages_and_assets_are_light_and_served_with_their_types(plain: ServerProcess):
    """Each page and everything it loads (its scripts' imports too) comes from the server, under 300 KB in all."""
    for page in ("/", "/dashboard"):
        response = httpx.get(plain.url + page, headers=BROWSER_ACCEPT)
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert "script-src 'self'" in response.headers["content-security-policy"]
        parser = AssetLinks()
        parser.feed(response.text)
        assert parser.links and all(link.startswith("/webui/") for link in parser.links), parser.links
        pending, fetched = list(parser.links), {page: len(response.content)}
        while pending:
            path = pending.pop()
            if path in fetched:
                continue
            asset = httpx.get(plain.url + path)
            assert asset.status_code == 200, path
            assert asset.headers["cache-control"] == "no-cache"
            assert asset.headers["x-content-type-options"] == "nosniff"
            fetched[path] = len(asset.content)
            if path.endswith(".js"):
                assert asset.headers["content-type"] == "text/javascript; charset=utf-8"
                pending += ["/webui/" + name for name in re.findall(r'from "\./([\w.-]+)"', asset.text)]
                assert "innerHTML" not in asset.text and "outerHTML" not in asset.text, path
            elif path.endswith(".css"):
                assert asset.headers["content-type"] == "text/css; charset=utf-8"
        assert {"/webui/common.js", "/webui/style.css"} <= fetched.keys()
        assert sum(fetched.values()) < PAGE_WEIGHT_LIMIT, fetched
    # An unchanged asset is not sent again.
    first = httpx.get(plain.url + "/webui/chat.js")
    again = httpx.get(plain.url + "/webui/chat.js", headers={"If-None-Match": first.headers["etag"]})
    assert (again.status_code, again.content) == (304, b"")
    error_envelope(httpx.get(plain.url + "/webui/missing.js"), 404, "route_not_found")
    error_envelope(httpx.get(plain.url + "/webui/..%2Fapp.py"), 404, "route_not_found")


def test_reply_streams_token_by_token_with_its_numbers(browser, plain: ServerProcess, artefacts: Path):
    open_chat(browser, plain.url)
    set_field(browser, "temperature", "0")
    set_field(browser, "seed", "7")
    set_field(browser, "max-tokens", "64")
    send_message(browser, STORY)
    lengths = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        streaming = bool(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant.streaming"))
        text = last_reply_text(browser) or ""
        if streaming and text and (not lengths or len(text) != lengths[-1]):
            lengths.append(len(text))
        if not streaming and idle(browser):
            break
        time.sleep(0.02)
    # Markdown may hide a marker once its span closes, so the text grows in steps that are not always longer.
    assert len(set(lengths)) >= 3 and lengths[0] < lengths[-1], lengths
    user, reply = current_messages(browser)
    assert user == {"role": "user", "content": STORY}
    # The streamed text is the greedy answer to the same request.
    expected = answer(post(plain.url, "/v1/chat/completions", {
        "model": MODEL, "messages": [user], "max_tokens": 64, **GREEDY}))
    assert reply["content"] == expected["choices"][0]["message"]["content"]
    assert reply["finish_reason"] == expected["choices"][0]["finish_reason"]
    assert reply["stats"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert reply["stats"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text
    assert f"{expected['usage']['prompt_tokens']} prompt tokens" in stats
    assert re.search(r"\d+ cached", stats) and re.search(r"prefill [\d.]+ tok/s", stats), stats
    assert re.search(r"decode [\d.]+ tok/s", stats), stats
    browser.save_screenshot(str(artefacts / "chat.png"))


def test_forced_tool_call_is_shown_with_its_arguments(browser, plain: ServerProcess):
    open_chat(browser, plain.url)
    new_chat(browser)
    set_field(browser, "tools", json.dumps(WEATHER_TOOL))
    set_field(browser, "tool-choice", "required")
    send_message(browser, "What is the weather in Paris?")
    wait_idle(browser)
    reply = current_messages(browser)[-1]
    assert reply["finish_reason"] == "tool_calls"
    [call] = reply["tool_calls"]
    assert call["name"] == "get_weather" and call["id"]
    shown = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .tool-call")
    assert shown.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    assert json.loads(shown.find_element(By.CSS_SELECTOR, ".tool-args").text) == json.loads(call["arguments"])
    assert set(json.loads(call["arguments"])) == {"city"}
    set_field(browser, "tools", "")


def test_stop_ends_a_long_reply_and_the_page_stays_usable(browser, plain: ServerProcess):
    open_chat(browser, plain.url)
    new_chat(browser)
    set_field(browser, "max-tokens", "900")
    send_message(browser, "Count from 1 to 1000, one number per line.")
    wait_for(browser, lambda d: len(last_reply_text(d) or "") > 20, message="the reply to begin")
    browser.find_element(By.ID, "stop").click()
    wait_idle(browser, 10)
    stopped_at = last_reply_text(browser)
    time.sleep(1.0)
    assert last_reply_text(browser) == stopped_at
    reply = current_messages(browser)[-1]
    assert reply["stopped"] is True and "finish_reason" not in reply
    assert browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stat-stopped").text == "stopped"
    # The server saw the client go and freed the slot.
    wait_for(browser, lambda _: not any(slots_busy(plain.url)), 10, "the slot to be freed")
    set_field(browser, "max-tokens", "12")
    send_message(browser, "Say hello.")
    wait_idle(browser)
    messages = current_messages(browser)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1]["content"] and messages[-1]["finish_reason"] in ("stop", "length")


def test_regenerate_and_edit_and_resend(browser, plain: ServerProcess):
    open_chat(browser, plain.url)
    before = current_messages(browser)
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant:last-child .regenerate").click()
    wait_idle(browser)
    after = current_messages(browser)
    assert [m["role"] for m in after] == [m["role"] for m in before]
    assert after[-1]["content"] and after[:-1] == before[:-1]
    browser.find_elements(By.CSS_SELECTOR, ".msg.user .edit")[-1].click()
    editor = browser.find_element(By.CSS_SELECTOR, ".edit-box")
    editor.clear()
    editor.send_keys("Say goodbye.")
    browser.find_element(By.CSS_SELECTOR, ".resend").click()
    wait_idle(browser)
    edited = current_messages(browser)
    assert edited[:2] == before[:2] and edited[2] == {"role": "user", "content": "Say goodbye."}
    assert len(edited) == 4 and edited[3]["role"] == "assistant"


def test_conversations_survive_a_reload(browser, plain: ServerProcess):
    open_chat(browser, plain.url)
    titles = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".conversation .open")]
    shown = browser.find_element(By.ID, "transcript").text
    assert len(titles) == 3 and titles[-1] == STORY, titles
    browser.refresh()
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".conversation .open"))
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".conversation .open")] == titles
    assert browser.find_element(By.ID, "transcript").text == shown
    browser.find_elements(By.CSS_SELECTOR, ".conversation .open")[-1].click()
    assert STORY in browser.find_element(By.ID, "transcript").text


def test_model_output_is_never_markup(browser, plain: ServerProcess, tmp_path: Path, artefacts: Path):
    """Imported and streamed model output with a <script>, an <img onerror> and a javascript: link stays text."""
    conversation = {"title": "hostile", "messages": [
        {"role": "user", "content": "Show me some HTML."}, {"role": "assistant", "content": HOSTILE}]}
    exported = tmp_path / "import.json"
    exported.write_text(json.dumps({"format": "basert.chat", "version": 1, "conversations": [conversation]}))
    open_chat(browser, plain.url)
    browser.find_element(By.ID, "import").send_keys(str(exported))
    wait_for(browser, lambda d: "hostile" in d.find_element(By.CSS_SELECTOR, ".conversation.active").text)

    def check_inert() -> None:
        transcript = browser.find_element(By.ID, "transcript")
        assert browser.execute_script("return window.__pwned") is None
        assert not transcript.find_elements(By.CSS_SELECTOR, "script, img, b, iframe, object")
        content = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")[-1]
        text = content.get_attribute("textContent")
        assert "<script>window.__pwned = 'script'</script>" in text
        assert "<img src=x onerror=\"window.__pwned = 'img'\">" in text
        assert "[click me](javascript:window.__pwned='link')" in text
        hrefs = [a.get_attribute("href") for a in transcript.find_elements(By.CSS_SELECTOR, "a")]
        assert "https://example.com/docs" in hrefs, hrefs
        assert all(href.startswith(("http://", "https://")) for href in hrefs), hrefs

    check_inert()
    # The server continues the hostile text (an assistant prefill): the page renders it again as it streams.
    set_field(browser, "max-tokens", "16")
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant .continue").click()
    wait_idle(browser)
    reply = current_messages(browser)[-1]
    assert reply["content"].startswith(HOSTILE) and len(reply["content"]) > len(HOSTILE)
    check_inert()
    assert browser.execute_script("return document.querySelectorAll('script').length") == 1  # the page's own
    browser.save_screenshot(str(artefacts / "chat-hostile-output.png"))


MARKDOWN = """# Title
Some **bold**, *italic*, `a < b` and ~~gone~~ text, see https://example.org/x.

- one
- two
  - nested

3. third
4. fourth

> quoted

| name | count |
|------|:-----:|
| cats | 2 |

```python
print("<b>hi</b>")
```"""
# What the page makes of MARKDOWN: (tag, text) of each element of the reply, in document order.
MARKDOWN_ELEMENTS = [
    ("h1", "Title"), ("p", "Some bold, italic, a < b and gone text, see https://example.org/x."), ("strong", "bold"),
    ("em", "italic"), ("code", "a < b"), ("del", "gone"), ("a", "https://example.org/x"),
    ("ul", "onetwonested"), ("li", "one"), ("p", "one"), ("li", "twonested"), ("p", "two"), ("ul", "nested"),
    ("li", "nested"), ("p", "nested"), ("ol", "thirdfourth"), ("li", "third"), ("p", "third"), ("li", "fourth"),
    ("p", "fourth"), ("blockquote", "quoted"), ("p", "quoted"), ("div", "namecountcats2"), ("table", "namecountcats2"),
    ("thead", "namecount"), ("tr", "namecount"), ("th", "name"), ("th", "count"), ("tbody", "cats2"),
    ("tr", "cats2"), ("td", "cats"), ("td", "2"), ("pre", 'print("<b>hi</b>")'), ("code", 'print("<b>hi</b>")'),
]


def test_markdown_becomes_elements(browser, plain: ServerProcess, tmp_path: Path):
    exported = tmp_path / "markdown.json"
    exported.write_text(json.dumps([{"title": "markdown", "messages": [
        {"role": "user", "content": "Format this."}, {"role": "assistant", "content": MARKDOWN}]}]))
    open_chat(browser, plain.url)
    browser.find_element(By.ID, "import").send_keys(str(exported))
    wait_for(browser, lambda d: "markdown" in d.find_element(By.CSS_SELECTOR, ".conversation.active").text)
    elements = browser.execute_script(
        "return [...document.querySelectorAll('.msg.assistant .content *')]"
        ".map((e) => [e.tagName.toLowerCase(), e.textContent]);")
    assert [tuple(e) for e in elements] == MARKDOWN_ELEMENTS
    content = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .content")
    assert content.find_element(By.CSS_SELECTOR, "a").get_attribute("href") == "https://example.org/x"
    assert content.find_element(By.CSS_SELECTOR, "ol").get_attribute("start") == "3"
    assert content.find_element(By.CSS_SELECTOR, "pre code").get_attribute("data-language") == "python"
    assert content.find_elements(By.CSS_SELECTOR, "th")[1].value_of_css_property("text-align") == "center"


def test_reasoning_is_shown_folded(browser, plain: ServerProcess):
    """A reply that reasons (here: a prefill that opens a <think> block, continued) shows it in a closed <details>."""
    conversation = {"title": "thinking", "messages": [
        {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "<think>\nThe user asks"}]}
    open_chat(browser, plain.url)
    browser.execute_script("localStorage.setItem('basert.chat.conversations', JSON.stringify([arguments[0],"
                           "...JSON.parse(localStorage.getItem('basert.chat.conversations'))]))", conversation)
    open_chat(browser, plain.url)
    set_field(browser, "max-tokens", "12")
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant .continue").click()
    wait_idle(browser)
    reply = current_messages(browser)[-1]
    assert reply["reasoning"] and reply["content"] == "<think>\nThe user asks"
    details = browser.find_element(By.CSS_SELECTOR, ".msg.assistant details.reasoning")
    assert details.get_attribute("open") is None
    assert details.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert details.find_element(By.CSS_SELECTOR, ".reasoning-body").get_attribute("textContent") == reply["reasoning"]


def test_dashboard_shows_busy_slots_and_the_prefix_cache_hits(browser, plain: ServerProcess, artefacts: Path):
    def request(i: int, **fields) -> dict:
        return {"model": MODEL, "messages": [{"role": "system", "content": SHARED_PREFIX},
                                             {"role": "user", "content": f"Where is vessel number {i}?"}],
                "temperature": 0, **fields}

    # Two of the four prompts sent once before, so they are found whole in the prefix cache; all share the prefix.
    for i in (0, 1):
        answer(post(plain.url, "/v1/chat/completions", request(i, max_tokens=1)))
    stop = threading.Event()
    streaming = threading.Semaphore(0)

    def run(i: int) -> None:
        body = request(i, max_tokens=600, ignore_eos=True, stream=True)
        with httpx.stream("POST", plain.url + "/v1/chat/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                streaming.release()
                if stop.is_set():
                    break

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        browser.get(plain.url + "/dashboard")
        wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.slot.busy")) == 4, 60, "4 busy slots")
        wait_for(browser, lambda d: re.fullmatch(r"[\d.]+ tok/s", d.find_element(By.ID, "decode-rate").text)
                 and float(d.find_element(By.ID, "decode-rate").text.split()[0]) > 0, 30, "a decode rate")
        metrics = httpx.get(plain.url + "/metrics").text
        prompt, cached = (sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))
                          for name in ("basert_prompt_tokens_total", "basert_cached_prompt_tokens_total"))
        assert cached > 0
        wait_for(browser, lambda d: d.find_element(By.ID, "hit-rate-detail").text.startswith(
            f"{cached:.0f} of {prompt:.0f} prompt tokens"), 10, "the hit rate of the finished requests")
        rate = browser.find_element(By.ID, "hit-rate").text
        assert rate.endswith("%") and float(rate[:-1]) > 0
        assert abs(float(rate[:-1]) - 100 * cached / prompt) <= 0.5
        model_row = browser.find_element(By.CSS_SELECTOR, f"#models tr[data-key='{MODEL}']")
        assert "4 / 4" in model_row.text and "loaded" in model_row.text
        blocks_total = re.search(r"^basert_kv_blocks_total\{[^}]*\} (\S+)$", metrics, re.M).group(1)
        assert re.search(rf"\b\d+ / {float(blocks_total):.0f}\b", model_row.text), model_row.text
        browser.save_screenshot(str(artefacts / "dashboard.png"))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert streaming.acquire(timeout=0)
    wait_for(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, "tr.slot.busy"), 30, "the slots to be freed")


def test_dashboard_slot_actions(browser, plain: ServerProcess):
    """Save, erase and restore a slot from the dashboard (the server keeps snapshots in its --files-dir)."""
    browser.get(plain.url + "/dashboard")
    row = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "tr.slot[data-key='0']"))
    notice = browser.find_element(By.ID, "notice")
    row.find_element(By.CSS_SELECTOR, ".save").click()
    wait_for(browser, lambda _: notice.text.startswith("Saved slot 0"), message="the save")
    saved = re.fullmatch(rf"Saved slot 0 of {MODEL}: (\d+) tokens as (file-\w+)", notice.text)
    assert saved, notice.text
    listed = answer(httpx.get(plain.url + "/v1/files"))["data"]
    assert saved.group(2) in [f["id"] for f in listed]
    row.find_element(By.CSS_SELECTOR, ".erase").click()
    wait_for(browser, lambda _: notice.text == f"Erased slot 0 of {MODEL}: {saved.group(1)} tokens")
    row.find_element(By.CSS_SELECTOR, ".restore").click()
    field = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "dialog.ask .ask-input"))
    assert field.get_attribute("value") == saved.group(2)
    field.send_keys(Keys.ENTER)
    wait_for(browser, lambda _: notice.text == f"Restored slot 0 of {MODEL}: {saved.group(1)} tokens from "
             f"{saved.group(2)}")
    assert not browser.find_elements(By.CSS_SELECTOR, "#notice.error")


def network_address() -> str | None:
    """This machine's IPv4 address on its network (not loopback), if it has one: the address of the interface that
    its route to another network goes out through (a UDP "connection" sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_dashboard_offers_no_admin_actions_beyond_loopback(browser, plain: ServerProcess):
    """Without an API key the slot and model admin routes answer loopback clients only: a client on the network
    sees the models and the numbers, and neither the slots nor the buttons."""
    address = network_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")
    browser.get(f"http://{address}:{plain.port}/dashboard")
    note = wait_for(browser, lambda d: d.find_element(By.ID, "slots-note") if
                    d.find_element(By.ID, "slots-note").is_displayed() else None, message="the slots note")
    assert note.text.startswith("Slots and admin actions are not available to this client")
    row = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"#models tr[data-key='{MODEL}']"))
    assert "loaded" in row.text
    assert not row.find_element(By.CSS_SELECTOR, ".unload").is_displayed()
    assert not browser.find_elements(By.CSS_SELECTOR, "tr.slot")


def test_pages_with_an_api_key(browser, servers, artefacts: Path):
    """The pages load without the key; the first refused API call asks for it (again when it is wrong)."""
    keyed = servers[1]
    page = httpx.get(keyed.url + "/", headers=BROWSER_ACCEPT)
    assert page.status_code == 200 and page.text.startswith("<!doctype html>")
    error_envelope(httpx.get(keyed.url + "/v1/models"), 401, "invalid_api_key")
    browser.get(keyed.url + "/")
    field = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "dialog.ask[open] .ask-input"))
    field.send_keys("wrong-key", Keys.ENTER)
    label = wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "dialog.ask[open] label"))
    assert "refused" in label.text
    label.find_element(By.CSS_SELECTOR, ".ask-input").send_keys(API_KEY, Keys.ENTER)
    wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    assert browser.execute_script("return sessionStorage.getItem('basert.apiKey')") == API_KEY
    set_field(browser, "max-tokens", "8")
    send_message(browser, "Hi")
    wait_idle(browser)
    reply = current_messages(browser)[-1]
    assert reply["content"] and "error" not in reply
    # The dashboard (same origin, same tab) uses the key it has; with it the admin actions are allowed.
    browser.get(keyed.url + "/dashboard")
    wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.slot")) == 4)
    assert not browser.find_elements(By.CSS_SELECTOR, "dialog.ask")
    # Without a files store, a slot is saved llama.cpp's way: by file name under --slot-save-path.
    row = browser.find_element(By.CSS_SELECTOR, "tr.slot[data-key='0']")
    row.find_element(By.CSS_SELECTOR, ".save").click()
    notice = browser.find_element(By.ID, "notice")
    wait_for(browser, lambda _: notice.text.startswith("Saved slot 0"), message="the save")
    saved = re.fullmatch(rf"Saved slot 0 of {MODEL}: (\d+) tokens as (slot-{MODEL}-0\.bin)", notice.text)
    assert saved and (keyed.root / "slots" / saved.group(2)).is_file(), notice.text
    row.find_element(By.CSS_SELECTOR, ".restore").click()
    wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, "dialog.ask .ask-input")).send_keys(Keys.ENTER)
    wait_for(browser, lambda _: notice.text == f"Restored slot 0 of {MODEL}: {saved.group(1)} tokens from "
             f"{saved.group(2)}", message="the restore")
    unload = browser.find_element(By.CSS_SELECTOR, f"#models tr[data-key='{MODEL}'] .unload")
    assert unload.is_displayed()
    browser.save_screenshot(str(artefacts / "dashboard-keyed.png"))
    unload.click()
    wait_for(browser, lambda d: d.find_element(By.ID, "notice").text == f"Unloaded {MODEL}")
    wait_for(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"#models tr[data-key='{MODEL}']")
             .get_attribute("data-state") == "unloaded")


def test_no_webui_turns_the_pages_off(servers):
    without = servers[2]
    for path in ("/dashboard", "/webui/chat.js", "/webui/index.html"):
        error_envelope(httpx.get(without.url + path, headers=BROWSER_ACCEPT), 404, "route_not_found")
    # GET / answers as it did before the pages: not with a page (route_not_found, or another API's answer there).
    root = httpx.get(without.url + "/", headers=BROWSER_ACCEPT)
    assert root.status_code in (200, 404) and "text/html" not in root.headers["content-type"]
    assert answer(httpx.get(without.url + "/v1/models"))["data"][0]["id"] == MODEL
