"""Adapters in the server (tiny-gemma3): mount/unmount, per-request and stacked selection,
validation and path confinement, cache namespacing, and equality with in-process loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.lora import apply as lora_apply
from mlxlab.lora import io as lora_io
from mlxlab.serve.engine.jobs import Delta, Done, Job, Sampling
from tests.helpers.serve import free_port, make_adapter, make_client

PROMPT = [{"role": "user", "content": "What does the zip builtin do?"}]


@pytest.fixture(scope="module")
def root(tiny_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("adapters")
    make_adapter(tiny_dir("gemma3"), base / "a", seed=1)
    make_adapter(tiny_dir("gemma3"), base / "b", seed=2, targets=("q", "o", "down"), layers=3)
    make_adapter(tiny_dir("llama"), base / "llama", seed=3)
    return base


@pytest.fixture(scope="module")
def served(root):
    client, gateway = make_client(adapter_root=str(root))
    yield client, gateway
    gateway.stop()


def reply(client, adapter=None, **kw):
    body = {"messages": PROMPT, "max_tokens": 16, "temperature": 0, **kw}
    if adapter is not None:
        body["adapter"] = adapter
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text(r) -> str:
    return r["choices"][0]["message"]["content"]


def logits(model, tokenizer):
    ids = mx.array(tokenizer.encode("The zip builtin pairs items from iterables."))[None]
    return np.array(model(ids).astype(mx.float32))


def test_mount_select_stack_unmount(served, root, tiny_dir):
    client, gateway = served
    base = text(reply(client))
    assert client.post("/v1/adapters", json={"id": "a", "path": "a"}).json()["rank"] == 4
    card = client.post("/v1/adapters", json={"id": "b", "path": str(root / "b")}).json()
    assert card["mounted_layers"] == [3, 4, 5] and card["size_bytes"] > 0
    assert [a["id"] for a in client.get("/v1/adapters").json()["adapters"]] == ["a", "b"]
    # Mounted but unused: base output byte-identical.
    assert text(reply(client)) == base and text(reply(client, "none")) == base
    a1, b1 = text(reply(client, "a")), text(reply(client, "b"))
    assert a1 != base and b1 != base
    assert text(reply(client, "a")) == a1  # A -> B -> A
    # The in-process model with A loaded gives the same tokens.
    from mlx_lm import generate
    from mlx_lm.utils import load

    model, tok = load(str(tiny_dir("gemma3")))
    lora_io.load(model, root / "a")
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    assert generate(model, tok, prompt, max_tokens=16).startswith(a1)
    # Stacked a+b equals both deltas fused into the weights.
    loaded = gateway.loaded
    fused, _ = load(str(tiny_dir("gemma3")))
    for name in ("a", "b"):
        lora_io.load(fused, root / name)
        lora_apply.fuse(fused)
    loaded.adapters.selection.ids = ("a", "b")
    try:
        ours = logits(loaded.model, loaded.tokenizer)
    finally:
        loaded.adapters.selection.ids = ()
    np.testing.assert_allclose(ours, logits(fused, tok), atol=2e-4, rtol=1e-4)
    assert text(reply(client, "a+b")) not in (a1, b1)
    stats = client.get("/stats").json()["adapters"]["mounted"]
    assert {m["id"]: m["requests"] for m in stats} == {"a": 3, "b": 2}
    # Unmount: B gone, A and base unchanged; the wrappers B alone needed are removed.
    assert client.delete("/v1/adapters/b").json()["deleted"] is True
    assert client.delete("/v1/adapters/b").status_code == 404
    assert text(reply(client, "a")) == a1 and text(reply(client)) == base
    r = client.post("/v1/chat/completions", json={"messages": PROMPT, "adapter": "b"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_adapter"
    client.delete("/v1/adapters/a")
    from mlxlab.lora.multi import MultiLoRA

    assert not any(isinstance(m, MultiLoRA) for _, m in loaded.model.named_modules())
    assert (
        logits(loaded.model, loaded.tokenizer).tobytes()
        == logits(load(str(tiny_dir("gemma3")))[0], tok).tobytes()
    )


def test_prompt_cache_is_namespaced_per_adapter(served):
    client, _ = served
    client.post("/v1/adapters", json={"id": "ns", "path": "a"})
    try:
        sys_msgs = [{"role": "system", "content": "You are terse. " * 8}, *PROMPT]
        reply(client, "ns", messages=sys_msgs)
        again = reply(client, "ns", messages=sys_msgs)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        other = reply(
            client,
            "none",
            messages=[
                {"role": "system", "content": "You are terse. " * 8},
                {"role": "user", "content": "Something else entirely."},
            ],
        )
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        client.delete("/v1/adapters/ns")


def test_an_id_mounted_again_does_not_reuse_the_old_weights_cache(served):
    """The prompt cache outlives an unmount: an id mounted again from another directory must
    not reuse KV prefixes computed with the weights it named before."""
    client, _ = served
    msgs = [{"role": "system", "content": "You answer in one line. " * 8}, *PROMPT]
    client.post("/v1/adapters", json={"id": "cold", "path": "b"})
    client.post("/v1/adapters", json={"id": "re", "path": "a"})
    try:
        cold = reply(client, "cold", messages=msgs)  # B's answer, nothing cached under "cold"
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        reply(client, "re", messages=msgs)
        warm = reply(client, "re", messages=msgs)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert client.delete("/v1/adapters/re").status_code == 200
        assert client.post("/v1/adapters", json={"id": "re", "path": "b"}).status_code == 200
        again = reply(client, "re", messages=msgs)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert text(again) == text(cold) != text(warm)
    finally:
        client.delete("/v1/adapters/re")
        client.delete("/v1/adapters/cold")


def test_validation_is_all_or_nothing_and_paths_are_confined(served, root, tmp_path):
    client, gateway = served
    wrong = client.post("/v1/adapters", json={"id": "x", "path": "llama"})
    assert wrong.status_code == 400
    assert (
        "does not fit" in wrong.json()["error"]["message"]
        or "another base model" in wrong.json()["error"]["message"]
    )
    assert wrong.json()["error"]["code"] == "adapter_model_mismatch"
    # A corrupt adapter of the right base "does not fit" too, but is not another base's.
    import shutil

    corrupt = root / "corrupt"
    shutil.copytree(root / "a", corrupt, dirs_exist_ok=True)
    weights = mx.load(str(corrupt / lora_io.WEIGHTS))
    weights[next(iter(weights))] = mx.zeros((3, 3))
    mx.save_safetensors(str(corrupt / lora_io.WEIGHTS), weights)
    r = client.post("/v1/adapters", json={"id": "x", "path": "corrupt"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_adapter", r.text
    assert "does not fit" in err["message"] and "shape (3, 3)" in err["message"]
    # More layers than the model has: another base.
    deep = root / "deep"
    shutil.copytree(root / "a", deep, dirs_exist_ok=True)
    config = json.loads((deep / lora_io.CONFIG).read_text())
    (deep / lora_io.CONFIG).write_text(json.dumps({**config, "num_layers": 99}))
    r = client.post("/v1/adapters", json={"id": "x", "path": "deep"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "adapter_model_mismatch", r.text
    assert "num_layers=99" in err["message"]
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text("{not json")
    r = client.post("/v1/adapters", json={"id": "x", "path": "broken"})
    assert (
        r.status_code == 400
        and "adapter_config.json" in r.json()["error"]["message"]
        and "adapters.safetensors" in r.json()["error"]["message"]
    )  # every problem listed
    missing = client.post("/v1/adapters", json={"id": "x", "path": "nothing-here"})
    assert (
        missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_path_not_found"
    )
    for path in ("../outside", str(tmp_path), "/etc"):
        r = client.post("/v1/adapters", json={"id": "x", "path": path})
        assert r.status_code == 403 and r.json()["error"]["code"] == "outside_adapter_root"
    outside = tmp_path / "elsewhere"
    make_adapter(gateway.loaded.model_dir, outside, seed=5)
    link = root / "sneaky"
    if not link.exists():
        os.symlink(outside, link)
    assert client.post("/v1/adapters", json={"id": "x", "path": "sneaky"}).status_code == 403
    assert client.post("/v1/adapters", json={"id": "a+b", "path": "a"}).status_code == 400
    assert client.get("/v1/adapters").json()["adapters"] == []  # nothing was mounted
    listed = {a["path"] for a in client.get("/v1/adapters/available").json()["adapters"]}
    assert {"a", "b", "llama"} <= listed and "broken" not in listed


def test_mount_waits_for_the_running_generation(served, root):
    """A mount queued while a generation runs happens after that generation's last event."""
    client, gateway = served
    tok = gateway.loaded.tokenizer
    reference = text(reply(client, max_tokens=48))
    events, first = [], threading.Event()

    def sink(ev):  # slows the generation down (~20 ms a token) so the mount arrives mid-way
        events.append(ev)
        first.set()
        time.sleep(0.02)

    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    job = Job(prompt=list(prompt), max_tokens=48, sink=sink, sampling=Sampling(temperature=0.0))
    gateway.submit(job)
    assert first.wait(60)
    assert gateway.running is job  # still generating when the mount is queued
    seen_before = len(events)
    mounted = client.post("/v1/adapters", json={"id": "mid", "path": "b"})
    try:
        assert mounted.status_code == 200
        assert (
            isinstance(events[-1], Done) and len(events) > seen_before + 1
        )  # it waited for the end
        assert "".join(e.text for e in events if isinstance(e, Delta)) == reference
    finally:
        client.delete("/v1/adapters/mid")


def test_concurrent_requests_with_different_adapters_do_not_mix(served):
    client, _ = served
    client.post("/v1/adapters", json={"id": "a", "path": "a"})
    client.post("/v1/adapters", json={"id": "b", "path": "b"})
    try:
        solo = {spec: text(reply(client, spec)) for spec in ("none", "a", "b", "a+b")}
        results, threads = [], []
        for spec in ["a", "b", "none", "a+b"] * 3:
            th = threading.Thread(target=lambda s=spec: results.append((s, text(reply(client, s)))))
            threads.append(th)
            th.start()
        for th in threads:
            th.join(60)
        assert len(results) == 12 and all(solo[s] == t for s, t in results)
    finally:
        client.delete("/v1/adapters/a")
        client.delete("/v1/adapters/b")


@pytest.mark.slow  # a subprocess server
def test_mount_switch_off_and_start_time_mounts(root, tiny_dir, tmp_path):
    client, gateway = make_client(
        adapter_root=str(root), allow_adapter_mount=False, adapters={"a": str(root / "a")}
    )
    try:
        assert [a["id"] for a in client.get("/v1/adapters").json()["adapters"]] == ["a"]
        assert client.post("/v1/adapters", json={"id": "b", "path": "b"}).status_code == 403
        assert client.delete("/v1/adapters/a").status_code == 403
    finally:
        gateway.stop()
    # A training run directory mounts its final adapter; a bad one stops the server with one line.
    run = tmp_path / "run"
    make_adapter(tiny_dir("gemma3"), run / "adapter", seed=9)
    (run / "checkpoints" / "0000010").mkdir(parents=True)
    assert lora_io.resolve_dir(run) == run / "adapter"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxlab",
            "serve",
            "model=tiny-gemma3",
            f"port={free_port()}",  # a fixed one may be taken
            f"+adapters.bad={root / 'llama'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and ("does not fit" in r.stderr or "another base model" in r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # mlx_lm lora in a subprocess
def test_mlx_lm_trained_adapter_mounts(served, tiny_dir, root):
    """An adapter written by `mlx_lm lora` (its own layout, keys omitted) mounts and changes output."""
    from tests.helpers.cli import REPO

    client, _ = served
    out = root / "from_mlx_lm"
    if not out.exists():
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm",
            "lora",
            "--model",
            str(tiny_dir("gemma3")),
            "--train",
            "--data",
            str(REPO / "mlxlab" / "data" / "quickstart"),
            "--iters",
            "2",
            "--batch-size",
            "2",
            "--num-layers",
            "2",
            "--learning-rate",
            "5e-2",
            "--max-seq-length",
            "96",
            "--adapter-path",
            str(out),
            "--val-batches",
            "1",
            "--steps-per-eval",
            "100",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    card = client.post("/v1/adapters", json={"id": "m", "path": "from_mlx_lm"}).json()
    try:
        assert card["mounted_layers"] == [4, 5]
        assert json.loads((out / "adapter_config.json").read_text())["fine_tune_type"] == "lora"
        assert reply(client, "m")["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        client.delete("/v1/adapters/m")


def fake_adapter_dir(path) -> None:
    """What GET /v1/adapters/available looks for (the two file names), nothing loadable."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapters.safetensors").write_bytes(b"")


def test_default_adapter_root_belongs_to_mlxlab(tiny_dir, tmp_path, monkeypatch):
    """Started from a shared directory, the server neither lists nor confines mounts to it: the
    default root is ./outputs (the runs directory) when it exists, else MLXLAB_HOME/adapters
    (created); the ready line names it; adapter_root= still chooses."""
    from mlxlab.serve.cli import ready_line
    from mlxlab.serve.engine.adapters import resolve_root

    model = str(tiny_dir("gemma3"))  # a directory: found whatever MLXLAB_HOME says
    shared, home = tmp_path / "shared", tmp_path / "home"
    fake_adapter_dir(shared / "left_by_someone")
    monkeypatch.chdir(shared)
    monkeypatch.setenv("MLXLAB_HOME", str(home))
    assert resolve_root("elsewhere") == shared / "elsewhere"

    client, gateway = make_client(model=model)
    try:
        got = client.get("/v1/adapters/available").json()
        assert got == {"root": str(home / "adapters"), "adapters": []}
        assert (home / "adapters").is_dir()
        assert f"adapter root {home / 'adapters'}" in ready_line(client.app.state.cfg, gateway)
        r = client.post("/v1/adapters", json={"id": "x", "path": str(shared / "left_by_someone")})
        assert r.status_code == 403 and r.json()["error"]["code"] == "outside_adapter_root"
    finally:
        gateway.stop()

    fake_adapter_dir(shared / "outputs" / "quickstart" / "run1" / "adapter")
    assert resolve_root(None) == shared / "outputs"
    client, gateway = make_client(model=model)
    try:
        got = client.get("/v1/adapters/available").json()
        assert got["root"] == str(shared / "outputs")
        assert [a["path"] for a in got["adapters"]] == ["quickstart/run1/adapter"]
    finally:
        gateway.stop()
