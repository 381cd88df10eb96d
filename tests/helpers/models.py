"""What the tests of several models behind one server share (tests/test_serve_models.py,
tests/test_serve_mounts.py; their fixtures `alone` and `server` are in tests/conftest.py)."""

from __future__ import annotations

import threading
import time

import httpx

from mlxlab.serve.engine.catalog import facts

PROMPTS = ("The zip builtin pairs", "Lists in Python are", "def main():")
SMALL = {"small": "tiny-llama", "qwen": "tiny-qwen2"}  # beside the default, tiny-gemma3


def complete(client, model, prompt, max_tokens=8) -> str:
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def stats_of(client, name) -> dict:
    return next(m for m in client.get("/stats").json()["models"]["models"] if m["id"] == name)


def wait_for(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def all_at_once(fn, work: list[tuple]) -> dict:
    """`fn(*w)` for every `w` in `work`, each on its own thread, all at once: {w: result}; any
    exception fails the test."""
    got, errors = {}, []

    def one(w):
        try:
            got[w] = fn(*w)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(w,)) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return got


def weights(tiny_dir, family) -> int:
    return facts(tiny_dir(family)).weight_bytes


def model_stats(url, name) -> dict:
    models = httpx.get(f"{url}/stats").json()["models"]["models"]
    return next(m for m in models if m["id"] == name)


def hold_engine(gateway) -> threading.Event:
    """Park the engine thread in a task of its own (`Gateway.between`) until the returned event
    is set: jobs wait in the queue holding their leases, and no load can finish meanwhile."""
    release, parked = threading.Event(), threading.Event()
    gateway.between(lambda: (parked.set(), release.wait(120)))
    assert parked.wait(30)
    return release


def post_in_thread(url, body, out: dict, key) -> threading.Thread:
    def post():
        out[key] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    t = threading.Thread(target=post)
    t.start()
    return t
