"""The browser pages in a real browser: Debian's chromium (/usr/bin/chromium; `.ci/run` installs
it) driven by Playwright's Python package pointed at it (never `playwright install`), against a
real server on tiny-gemma3 (random weights, so the text is nonsense; what is checked is that the
page shows exactly what the API generates) with two random adapters and a run directory written
by a real short training run. Accessibility: axe-core (the axe.min.js that the PyPI package
axe-playwright-python bundles) in the page, no serious or critical violations.

Screenshots of both pages are written to the test's temp dir; `MLXLAB_UPDATE_SCREENSHOTS=1`
copies them over docs/img/web_chat.png and docs/img/web_runs.png (docs/serving.md's)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from mlxlab.cli import packaged_data
from mlxlab.config import DataConfig, LoraConfig, OptimConfig
from mlxlab.train.config import TrainConfig
from tests.helpers.cli import REPO
from tests.helpers.serve import make_adapter, start_server

pytestmark = pytest.mark.slow  # a server, a training run and a browser: ~1-2 min

CHROMIUM = os.environ.get("MLXLAB_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY, ADMIN = "sk-page", "sk-admin"
RUN, RUN2, ITERS = "quickstart/tiny", "quickstart/tiny-lr3e-3", 6
PROMPT = "What does re.split do?"
SCREENSHOTS = REPO / "docs" / "img"
TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "description": "Set the temperature unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["C", "F"]}},
            "required": ["unit"],
        },
    },
}


@pytest.fixture(scope="module")
def site(tiny_dir, tmp_path_factory):
    """A real short training run and two random adapters under the adapter root, and a server on
    tiny-gemma3 with the adapters mounted, an API key and an admin key."""
    from mlxlab.train.cli import run as train

    root = tmp_path_factory.mktemp("web") / "outputs"
    model_dir = tiny_dir("gemma3")
    for run, lr, seed in ((RUN2, 3e-3, 1), (RUN, 1e-3, 0)):  # RUN is the newer
        train(
            TrainConfig(
                model="tiny-gemma3",
                out_dir=str(root / run),
                iters=ITERS,
                batch_size=2,
                val_every=2,
                save_every=0,
                log_every=1,
                wandb="disabled",
                compile=False,
                seed=seed,
                data=DataConfig(train=packaged_data("quickstart"), max_seq_length=96),
                lora=LoraConfig(targets=["q", "v"], rank=4),
                optim=OptimConfig(lr=lr, warmup=1),
            )
        )
    make_adapter(model_dir, root / "adapters" / "a", seed=1)
    make_adapter(model_dir, root / "adapters" / "b", seed=2)
    port, gateway, server, thread = start_server(
        adapter_root=str(root),
        adapters={"a": str(root / "adapters" / "a"), "b": str(root / "adapters" / "b")},
        api_key=KEY,
        admin_key=ADMIN,
    )
    try:
        yield {"url": f"http://127.0.0.1:{port}", "root": root.resolve()}
    finally:
        server.should_exit = True
        thread.join(30)
        gateway.stop()


@pytest.fixture(scope="module")
def browser():
    required = os.environ.get("MLXLAB_REQUIRE_BROWSER") == "1"  # .ci/run: fail, never skip
    if not os.access(CHROMIUM, os.X_OK):
        why = f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)"
        pytest.fail(why) if required else pytest.skip(why)
    try:
        from playwright import sync_api
    except ImportError:
        why = "no playwright (pip install -e '.[dev]')"
        pytest.fail(why) if required else pytest.skip(why)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)  # a fresh profile each
        yield b
        b.close()


class Tab:
    """A page in its own browser context (fresh storage), with the key in its session storage
    unless `key` is None; console errors (a CSP violation is one) and page errors are kept."""

    def __init__(self, browser, site, key: str | None = KEY, **context):
        self.context = browser.new_context(viewport={"width": 1280, "height": 800}, **context)
        self.page = self.context.new_page()
        self.url = site["url"]
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        if key is not None:
            self.page.add_init_script(f"sessionStorage.setItem('mlxlab.key', {json.dumps(key)})")

    def goto(self, path: str):
        self.page.goto(self.url + path)
        return self.page

    def close(self, expected_errors: int = 0):
        errors = [e for e in self.errors if "401" not in e and "403" not in e]
        self.context.close()
        assert len(errors) == expected_errors, errors


@pytest.fixture
def tab(browser, site):
    made = []

    def new(**kw) -> Tab:
        made.append(Tab(browser, site, **kw))
        return made[-1]

    yield new
    for t in made:
        t.close()


def api_answer(site, spec: str, messages: list[dict], **extra) -> dict:
    """The same request as the page's, without streaming, straight to the API."""
    body = {"messages": messages, "adapter": spec, "temperature": 0, "max_tokens": 40, **extra}
    r = httpx.post(
        site["url"] + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def settle(page, count: int = 1, timeout: float = 60_000):
    """Wait until `count` answers have finished (their stats line is drawn)."""
    page.wait_for_function(
        "n => document.querySelectorAll('.answer:not(.streaming) .stats').length >= n",
        arg=count,
        timeout=timeout,
    )


def content(page, side: str = "A", turn: int | None = None) -> str:
    return page.evaluate(
        """([side, turn]) => {
            const all = [...document.querySelectorAll(`.answer[data-side="${side}"]`)];
            const a = turn === null ? all[all.length - 1] : all[turn];
            return a.querySelector('.content').textContent;
        }""",
        [side, turn],
    )


def greedy(page, max_tokens: int = 40):
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))


def shoot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("MLXLAB_UPDATE_SCREENSHOTS"):
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SCREENSHOTS / name)


def test_the_page_asks_for_the_key_once_and_keeps_it_in_the_tab(tab):
    t = tab(key=None)
    page = t.goto("/")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert "wants an API key" in page.inner_text("#key-reason")
    page.fill("#key-input", "sk-wrong")
    page.click("#key-ok")
    page.wait_for_function(
        "() => document.querySelector('#key-reason').textContent.includes('refused')"
    )
    page.fill("#key-input", KEY)
    page.click("#key-ok")
    page.wait_for_function("() => document.querySelector('#adapter-help').dataset.mounted")
    assert page.get_attribute("#adapter-help", "data-mounted") == "a,b"
    assert page.evaluate("() => sessionStorage.getItem('mlxlab.key')") == KEY
    page.reload()
    page.wait_for_function("() => document.querySelector('#adapter-help').dataset.mounted")
    assert not dialog.is_visible()
    assert page.inner_text("#key-button") == "Key: set"


def test_an_answer_streams_token_by_token_as_the_api_generates_it(tab, site):
    page = tab().goto("/")
    greedy(page)
    page.evaluate(
        """() => {
            window.__lengths = [];
            new MutationObserver(() => {
                const a = document.querySelector('.answer.streaming .content');
                if (a) window.__lengths.push(a.textContent.length);
            }).observe(document.getElementById('log'),
                       {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    settle(page)
    seen = sorted({n for n in page.evaluate("() => window.__lengths") if n > 0})
    text = content(page)
    # the text grew in several steps while the answer was still streaming
    assert len(seen) >= 3 and seen[-1] <= len(text), seen
    want = api_answer(site, "none", [{"role": "user", "content": PROMPT}])
    assert text == want["choices"][0]["message"]["content"]
    stats = page.inner_text(".answer .stats")
    usage = want["usage"]
    assert f"{usage['completion_tokens']} tokens" in stats and "tok/s" in stats
    assert f"prompt {usage['prompt_tokens']} (cached " in stats
    assert "first token" in stats and "finish: " in stats
    assert page.inner_text(".answer .spec") == "adapter: none"


def test_two_adapters_answer_side_by_side_and_regenerate_takes_a_new_spec(tab, site, tmp_path):
    page = tab().goto("/")
    greedy(page)
    page.check("#compare")
    page.fill("#adapter-a", "none")
    page.fill("#adapter-b", "a")
    page.fill("#system", "You answer in one sentence.")
    page.fill("#prompt", PROMPT)
    page.click("#send")
    settle(page, 2)
    messages = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": PROMPT},
    ]
    base, tuned = content(page, "A"), content(page, "B")
    assert base == api_answer(site, "none", messages)["choices"][0]["message"]["content"]
    assert tuned == api_answer(site, "a", messages)["choices"][0]["message"]["content"]
    assert base != tuned
    a, b = (page.locator(f'.answers.compare .answer[data-side="{s}"]').bounding_box() for s in "AB")
    assert b["x"] >= a["x"] + a["width"] and abs(a["y"] - b["y"]) < 2  # side by side
    shoot(page, tmp_path, "web_chat.png")
    # switch side B to the stacked spec and regenerate that answer only
    page.fill("#adapter-b", "a+b")
    page.click('.answer[data-side="B"] .regenerate')
    settle(page, 2)
    page.wait_for_function(
        """() => document.querySelector('.answer[data-side="B"] .spec').textContent
                 === 'adapter: a+b'"""
    )
    settle(page, 2)
    stacked = content(page, "B")
    assert stacked == api_answer(site, "a+b", messages)["choices"][0]["message"]["content"]
    assert stacked != tuned and content(page, "A") == base
    # a second turn: each side continues its own conversation
    page.fill("#prompt", "And re.sub?")
    page.click("#send")
    settle(page, 4)
    for side, spec, own in (("A", "none", base), ("B", "a+b", stacked)):
        history = messages + [
            {"role": "assistant", "content": own},
            {"role": "user", "content": "And re.sub?"},
        ]
        got = api_answer(site, spec, history)["choices"][0]["message"]["content"]
        assert content(page, side, turn=1) == got


def test_a_tool_call_is_shown_as_a_call_and_its_result_goes_back(tab, site):
    page = tab().goto("/")
    greedy(page, max_tokens=120)
    page.click("#tools-section summary")
    page.fill("#tools", json.dumps([TOOL]))
    page.select_option("#tool-choice", "required")
    page.fill("#prompt", "Use Celsius.")
    page.click("#send")
    settle(page)
    assert page.inner_text(".tool-call .tool-name") == "set_unit"
    args = json.loads(page.inner_text(".tool-call .tool-args"))
    assert args["unit"] in ("C", "F")
    assert "finish: tool_calls" in page.inner_text(".answer .stats")
    assert page.inner_text(".answer .content") == ""  # the markup is not shown as text
    page.fill(".tool-results textarea", '{"ok": true}')
    page.click(".tool-results button")
    settle(page, 2)
    assert page.locator(".turn.tool").count() == 1
    assert page.locator(".answer .error").count() == 0  # the server took the tool message


def test_a_json_answer_is_shown_formatted(tab, site):
    page = tab().goto("/")
    greedy(page)
    schema = TOOL["function"]["parameters"]
    page.click("#format-section summary")
    page.select_option("#response-format", "json_schema")
    page.fill("#schema", json.dumps(schema))
    page.fill("#prompt", "Which unit?")
    page.click("#send")
    settle(page)
    want = api_answer(
        site,
        "none",
        [{"role": "user", "content": "Which unit?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )["choices"][0]["message"]["content"]
    shown = content(page)
    assert json.loads(shown) == json.loads(want) and shown == json.dumps(json.loads(want), indent=2)


def test_reasoning_is_shown_apart_from_the_answer(tab):
    """No tiny model has a thinking template, so this one stream comes from the server's own
    OpenAI encoder fed engine events (what a thinking model's request streams), routed to the
    page in place of the server's answer."""
    from mlxlab.serve import answer
    from mlxlab.serve.engine.jobs import Delta, Done
    from mlxlab.serve.openai.encode import ChatStream

    events = [
        Delta("reasoning", "The user asks about "),
        Delta("reasoning", "re.split."),
        Delta("content", "It splits a string "),
        Delta("content", "by a pattern."),
        Done("stop", prompt_tokens=12, completion_tokens=9, cached_tokens=4),
    ]
    head = {"id": "chatcmpl-1", "created": 1, "model": "tiny-gemma3"}
    sse = "".join(answer.encode(ChatStream(head, include_usage=True), events))
    t = tab()
    t.page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse),
    )
    page = t.goto("/")
    page.check("#thinking")
    page.fill("#prompt", PROMPT)
    page.click("#send")
    settle(page)
    assert page.inner_text(".answer details.reasoning summary") == "Reasoning"
    reasoning = page.eval_on_selector(".answer details.reasoning .text", "n => n.textContent")
    assert reasoning == "The user asks about re.split."
    assert content(page) == "It splits a string by a pattern."
    assert "9 tokens" in page.inner_text(".answer .stats")
    assert "prompt 12 (cached 4)" in page.inner_text(".answer .stats")


def test_the_runs_page_plots_real_runs_live_and_overlays_them(tab, site, tmp_path):
    page = tab().goto("/runs")
    metrics = site["root"] / RUN / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    n_loss = sum(1 for r in records if "loss" in r)
    n_val = sum(1 for r in records if "val_loss" in r)
    # the newest run is plotted at once: every metric it logged, every step
    loss = f'path.series[data-run="{RUN}"][data-metric="loss"]'
    page.wait_for_selector(f'{loss}[data-points="{n_loss}"]')
    val = f'path.series[data-run="{RUN}"][data-metric="val_loss"]'
    assert page.get_attribute(val, "data-points") == str(n_val)
    d = page.get_attribute(loss, "d")
    assert d.startswith("M") and d.count("L") == n_loss - 1  # a curve through every step
    for chart in ("loss", "lr", "tok_per_s", "peak_mem_gb", "grad_norm"):
        drawn = page.locator(f'figure[data-chart="{chart}"] path.series[data-metric="{chart}"]')
        assert drawn.count() == 1, chart
    assert page.locator('figure[data-chart="rewards"]').count() == 0  # not a DPO run
    row = page.locator(f'tr[data-run="{RUN}"]')
    assert "finished" in row.inner_text() and f"{ITERS} / {ITERS}" in row.inner_text()
    # the other run overlays it, in its own color
    page.locator(f'tr[data-run="{RUN2}"] input[type="checkbox"]').check()
    page.wait_for_selector(f'path.series[data-run="{RUN2}"][data-metric="loss"]')
    drawn = page.eval_on_selector_all(
        'figure[data-chart="loss"] path.series[data-metric="loss"]',
        "ps => ps.map(p => [p.dataset.run, p.getAttribute('stroke')])",
    )
    assert sorted(r for r, _ in drawn) == sorted([RUN, RUN2])
    assert len({c for _, c in drawn}) == 2
    # the values under the pointer
    box = page.locator('figure[data-chart="loss"] svg[role="img"]').bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2)
    tip = page.locator('figure[data-chart="loss"] .tooltip')
    tip.wait_for(state="visible")
    assert tip.inner_text().startswith("step ") and f"({RUN2})" in tip.inner_text()
    shoot(page, tmp_path, "web_runs.png")
    # a new line while the page is open: drawn without a reload, and the run counts as running
    page.evaluate("() => { window.__same_page = true; }")
    last = records[-1]
    with metrics.open("a") as f:
        f.write(json.dumps({**last, "step": last["step"] + 1, "loss": last["loss"] * 0.9}) + "\n")
    page.wait_for_selector(f'{loss}[data-points="{n_loss + 1}"]', timeout=15_000)
    page.wait_for_function(
        "run => document.querySelector(`tr[data-run='${run}']`).textContent.includes('running')",
        arg=RUN,
        timeout=15_000,
    )
    assert page.evaluate("() => window.__same_page") is True
    # a run that starts meanwhile appears in the list
    new = site["root"] / "quickstart" / "started-later"
    new.mkdir()
    (new / "config.yaml").write_text(f"model: tiny-gemma3\niters: {ITERS}\n")
    page.locator('tr[data-run="quickstart/started-later"]').wait_for(timeout=15_000)
    assert page.evaluate("() => window.__same_page") is True


def test_a_runs_adapter_mounts_with_one_click_and_the_admin_key(tab, site):
    t = tab()
    page = t.goto("/runs")
    mount = page.locator(f'tr[data-run="{RUN}"] button.mount')
    mount.click()
    page.locator("#key-dialog").wait_for(state="visible")  # the API key cannot mount
    assert "admin key" in page.inner_text("#key-reason")
    page.fill("#key-input", ADMIN)
    page.click("#key-ok")
    link = page.locator(f'tr[data-run="{RUN}"] a.chat-with')
    link.wait_for(timeout=30_000)
    mounted_id = link.inner_text()
    assert mounted_id == "quickstart-tiny"
    listed = httpx.get(
        site["url"] + "/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}
    ).json()
    card = next(a for a in listed["adapters"] if a["id"] == mounted_id)
    assert card["path"] == str(site["root"] / RUN / "adapter")
    try:
        link.click()
        page.wait_for_url("**/?adapter=quickstart-tiny")
        assert page.input_value("#adapter-a") == mounted_id
        greedy(page, max_tokens=8)
        page.fill("#prompt", PROMPT)
        page.click("#send")
        settle(page)
        assert page.inner_text(".answer .spec") == f"adapter: {mounted_id}"
        got = api_answer(site, mounted_id, [{"role": "user", "content": PROMPT}], max_tokens=8)
        assert content(page) == got["choices"][0]["message"]["content"]
    finally:
        httpx.delete(
            site["url"] + f"/v1/adapters/{mounted_id}",
            headers={"Authorization": f"Bearer {ADMIN}"},
        )


def axe_violations(page) -> list[dict]:
    from axe_playwright_python.base import AXE_SCRIPT

    page.evaluate(AXE_SCRIPT)  # through the debugger protocol: not an inline script
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]][:3]}
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_both_pages_pass_axe_with_no_serious_violations(tab, scheme):
    t = tab(color_scheme=scheme)
    page = t.goto("/")
    greedy(page, max_tokens=60)
    page.check("#compare")
    page.fill("#adapter-b", "a")
    page.click("#tools-section summary")
    page.fill("#tools", json.dumps([TOOL]))
    page.fill("#prompt", PROMPT)
    page.click("#send")
    settle(page, 2)
    assert axe_violations(page) == []
    page.click("#key-button")  # the key dialog too
    page.locator("#key-dialog").wait_for(state="visible")
    assert axe_violations(page) == []
    page.keyboard.press("Escape")
    page = t.goto("/runs")
    page.locator(f'tr[data-run="{RUN2}"] input[type="checkbox"]').check()
    page.wait_for_selector(f'path.series[data-run="{RUN2}"]')
    assert axe_violations(page) == []
    # and the checker does find what it should: a form field without a label
    page.evaluate("() => document.querySelector('#runs-body input').removeAttribute('aria-label')")
    assert [v["id"] for v in axe_violations(page)] == ["label"]
