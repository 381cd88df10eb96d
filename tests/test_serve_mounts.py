"""Mount lists and shared tokenizers of several models behind one server (engine/entries.py,
engine/models.py, engine/loader.py, admin/router.py): adapters mounted on a model other than the
default (POST /v1/adapters `model`, serve model_adapters.) answer as on that model served alone, are
mounted again when it reloads after an eviction (or reported, not_remounted, where their files have
gone or left the adapter root); an unmount while the model loads waits for the load; copies of a
model share one tokenizer."""

from __future__ import annotations

import json
import shutil
import threading
import time
import weakref

import httpx
import pytest

import mlxlab  # noqa: F401  (BLAS before MLX)
from mlxlab.serve.engine.admission import RESERVE_BYTES
from tests.helpers.models import (
    PROMPTS,
    SMALL,
    all_at_once,
    complete,
    hold_engine,
    model_stats,
    post_in_thread,
    stats_of,
    wait_for,
    weights,
)
from tests.helpers.serve import make_adapter, make_client


def test_adapter_of_another_model_is_refused_naming_both(tiny_dir, tmp_path):
    make_adapter(tiny_dir("gemma3"), tmp_path / "g", seed=1)
    client, gateway = make_client(models=SMALL, adapters={"g": str(tmp_path / "g")})
    try:
        body = {"prompt": "hi", "max_tokens": 2, "adapter": "g"}
        assert client.post("/v1/completions", json=body).status_code == 200
        r = client.post("/v1/completions", json={**body, "model": "small"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "adapter_model_mismatch" and err["param"] == "adapter", err
        assert "'tiny-gemma3'" in err["message"] and "'small'" in err["message"]
    finally:
        gateway.stop()


def ask_adapter(client, model, adapter, prompt=PROMPTS[0], max_tokens=8):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "adapter": adapter}
    return client.post("/v1/completions", json={**body, "model": model})


def text_of(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def llama_adapter(tiny_dir, tmp_path_factory):
    """An adapter root holding a tiny-llama adapter (l) and a tiny-gemma3 one (g), and the
    texts tiny-llama gives for PROMPTS with l, served as the default model, and its text for
    PROMPTS[0] with the stack l+again (again: l mounted a second time)."""
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(tiny_dir("llama"), root / "l", seed=3)
    make_adapter(tiny_dir("gemma3"), root / "g", seed=4)
    client, gateway = make_client(
        model="tiny-llama",
        adapter_root=str(root),
        adapters={"l": str(root / "l"), "again": str(root / "l")},
        batch=4,
    )
    try:
        texts = [text_of(ask_adapter(client, "tiny-llama", "l", p)) for p in PROMPTS]
        stacked = text_of(ask_adapter(client, "tiny-llama", "l+again"))
    finally:
        gateway.stop()
    assert stacked != texts[0]  # the stack is not l alone
    return root, texts, stacked


def test_an_adapter_mounted_on_another_model_answers_as_on_that_model_alone(llama_adapter, alone):
    """POST /v1/adapters with `model` loads that model and mounts the adapter on it: its texts
    are those of a server where that model is the default with that adapter, per row beside
    the base; the adapter belongs to that model alone (a 400 naming both elsewhere), an
    adapter not mounted on it is a 400 naming it, a mismatched base is refused naming both."""
    root, with_l, _ = llama_adapter
    client, gateway = make_client(models=SMALL, adapter_root=str(root), batch=4)
    try:
        r = client.post("/v1/adapters", json={"id": "l", "path": "l", "model": "small"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "small" and r.json()["id"] == "l"
        assert stats_of(client, "small")["state"] == "loaded"
        listed = client.get("/v1/adapters").json()["adapters"]
        assert [(a["id"], a["model"]) for a in listed] == [("l", "small")]
        assert client.get("/v1/adapters", params={"model": "tiny-gemma3"}).json() == {
            "adapters": []
        }
        assert stats_of(client, "small")["adapters"] == ["l"]
        # per row in one batch: the adapter's rows and the base's together
        work = [(i, a) for i in range(len(PROMPTS)) for a in ("l", "none")]
        got = all_at_once(lambda i, a: text_of(ask_adapter(client, "small", a, PROMPTS[i])), work)
        for i in range(len(PROMPTS)):
            assert got[i, "l"] == with_l[i], i
            assert got[i, "none"] == alone["small"][i], i
        # /stats and /metrics count small's adapter under small (the default has none)
        by_model = client.get("/stats").json()["adapters_by_model"]
        assert {m["id"]: m["requests"] for m in by_model["small"]["mounted"]} == {"l": len(PROMPTS)}
        assert by_model["tiny-gemma3"]["mounted"] == []
        from prometheus_client.parser import text_string_to_metric_families

        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples
        }
        per = ("mlxlab_adapter_requests_total", (("adapter", "l"), ("model", "small")))
        assert samples[per] == len(PROMPTS)
        assert samples["mlxlab_model_adapters_mounted", (("model", "small"),)] == 1
        assert samples["mlxlab_model_adapters_mounted", (("model", "tiny-gemma3"),)] == 0
        # the default model does not have it
        r = ask_adapter(client, "tiny-gemma3", "l")
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_model_mismatch"
        assert "'small'" in r.json()["error"]["message"]
        assert "'tiny-gemma3'" in r.json()["error"]["message"]
        # an adapter not mounted on small: a 400 naming small and its adapters
        r = ask_adapter(client, "small", "nope")
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unknown_adapter", r.text
        assert "'small'" in err["message"] and "mounted: l" in err["message"]
        # an adapter of another base: refused naming both
        r = client.post("/v1/adapters", json={"id": "g", "path": "g", "model": "small"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "adapter_model_mismatch", r.text
        assert "'g'" in err["message"] and "'small'" in err["message"]
        # it mounts on its own base, the default, under the same id as small's adapter
        r = client.post("/v1/adapters", json={"id": "l", "path": "g"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-gemma3", r.text
        assert text_of(ask_adapter(client, "tiny-gemma3", "l", max_tokens=2))
        assert client.delete("/v1/adapters/l").json()["model"] == "tiny-gemma3"
        # DELETE names the model; without it, the default's (a 404 saying where it is)
        r = client.delete("/v1/adapters/l")
        assert r.status_code == 404 and "?model=small" in r.json()["error"]["message"]
        assert client.delete("/v1/adapters/l", params={"model": "qwen"}).status_code == 404
        assert stats_of(client, "qwen")["state"] == "unloaded"  # not loaded for a DELETE
        assert client.delete("/v1/adapters/l", params={"model": "nothing"}).status_code == 404
        r = client.delete("/v1/adapters/l", params={"model": "small"})
        assert r.status_code == 200 and r.json()["model"] == "small"
        assert client.get("/v1/adapters").json()["adapters"] == []
        r = client.post("/v1/adapters", json={"id": "x", "path": "l", "model": "nothing"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        gateway.stop()


def test_a_reloaded_model_mounts_its_mount_list_again(tiny_dir, llama_adapter):
    """A model's mount list is what each of its loads mounts: `model_adapters.small.l=PATH`,
    plus runtime mounts (POST /v1/adapters), minus unmounts (DELETE, also while it is not
    loaded). After an eviction the reloaded model answers with a runtime mount as before; a
    runtime mount whose files have gone is reported (/stats `not_remounted`) and dropped,
    and the reload goes on."""
    root, with_l, stacked = llama_adapter
    shutil.copytree(root / "l", root / "copy")
    w = {f: weights(tiny_dir, f) for f in ("gemma3", "llama", "qwen2")}
    budget = RESERVE_BYTES + w["gemma3"] + max(w["llama"], w["qwen2"]) + 600_000
    client, gateway = make_client(
        models=SMALL,
        model_adapters={"small": {"l": str(root / "l")}},
        adapter_root=str(root),
        memory_budget_gb=budget / 1e9,
        prefill_step=16,
    )
    try:
        assert text_of(ask_adapter(client, "small", "l")) == with_l[0]
        for adapter_id, path in (("again", "l"), ("gone", "copy"), ("dropped", "l")):
            r = client.post("/v1/adapters", json={"id": adapter_id, "path": path, "model": "small"})
            assert r.status_code == 200, r.text
        before = text_of(ask_adapter(client, "small", "again"))
        assert before == with_l[0]
        # a stack, as on a server where small's model is the default
        assert text_of(ask_adapter(client, "small", "l+again")) == stacked
        complete(client, "qwen", PROMPTS[1])  # evicts small
        assert stats_of(client, "small")["state"] == "unloaded"
        assert client.get("/v1/adapters").json()["adapters"] == []
        # unmounted while small is not loaded: off its list (nothing is loaded for it)
        r = client.delete("/v1/adapters/dropped", params={"model": "small"})
        assert r.status_code == 200 and r.json()["model"] == "small", r.text
        assert stats_of(client, "small")["state"] == "unloaded"
        assert client.delete("/v1/adapters/dropped", params={"model": "small"}).status_code == 404
        shutil.rmtree(root / "copy")  # gone before the reload
        # reloads small: the runtime mount answers as before the eviction
        assert text_of(ask_adapter(client, "small", "again")) == before
        assert stats_of(client, "small")["loads"] == 2
        assert text_of(ask_adapter(client, "small", "l+again")) == stacked
        assert text_of(ask_adapter(client, "small", "l", PROMPTS[1])) == with_l[1]
        listed = client.get("/v1/adapters", params={"model": "small"}).json()["adapters"]
        assert sorted(a["id"] for a in listed) == ["again", "l"]
        gone = client.get("/stats").json()["adapters_by_model"]["small"]["not_remounted"]
        assert [(g["id"], g["path"]) for g in gone] == [("gone", str((root / "copy").resolve()))]
        assert set(gateway.models.entries["small"].mounts) == {"l", "again"}  # gone: dropped
        r = ask_adapter(client, "small", "gone")
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_adapter", r.text
    finally:
        gateway.stop()


def test_a_remount_stays_under_the_root_and_its_report_outlasts_the_load(
    tiny_dir, llama_adapter, tmp_path
):
    """A runtime mount whose directory resolves outside the adapter root by its reload (a
    folder on its path swapped for a link out of the root) is not mounted again: reported in
    `not_remounted` as one whose files have gone, the reload goes on. The report is the
    model's: it outlasts the next eviction and load, until the id is mounted again."""
    root, with_l, _ = llama_adapter
    sub, outside = root / "sub", tmp_path / "outside"
    shutil.copytree(root / "l", sub / "l")
    shutil.copytree(root / "l", outside / "l")
    w = {f: weights(tiny_dir, f) for f in ("gemma3", "llama", "qwen2")}
    budget = RESERVE_BYTES + w["gemma3"] + max(w["llama"], w["qwen2"]) + 600_000
    client, gateway = make_client(
        models=SMALL, adapter_root=str(root), memory_budget_gb=budget / 1e9, prefill_step=16
    )

    def reported(by_model=True):
        if by_model:
            gone = client.get("/stats").json()["adapters_by_model"]["small"]["not_remounted"]
        else:
            gone = stats_of(client, "small")["not_remounted"]
        return [g["id"] for g in gone]

    try:
        for adapter_id, path in (("swapped", "sub/l"), ("kept", "l")):
            r = client.post("/v1/adapters", json={"id": adapter_id, "path": path, "model": "small"})
            assert r.status_code == 200, r.text
        complete(client, "qwen", PROMPTS[1])  # evicts small
        assert stats_of(client, "small")["state"] == "unloaded"
        shutil.rmtree(sub)
        sub.symlink_to(outside, target_is_directory=True)
        assert text_of(ask_adapter(client, "small", "kept")) == with_l[0]  # reloads small
        assert stats_of(client, "small")["loads"] == 2
        r = ask_adapter(client, "small", "swapped")
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_adapter", r.text
        (gone,) = client.get("/stats").json()["adapters_by_model"]["small"]["not_remounted"]
        assert gone["id"] == "swapped" and "outside the adapter root" in gone["error"]
        # kept across the next eviction and load
        complete(client, "qwen", PROMPTS[1])
        assert stats_of(client, "small")["state"] == "unloaded"
        assert reported(by_model=False) == ["swapped"]
        complete(client, "small", PROMPTS[0])
        assert stats_of(client, "small")["loads"] == 3
        assert reported() == ["swapped"] and reported(by_model=False) == ["swapped"]
        # mounted again: the report is cleared
        r = client.post("/v1/adapters", json={"id": "swapped", "path": "l", "model": "small"})
        assert r.status_code == 200, r.text
        assert reported() == [] and reported(by_model=False) == []
    finally:
        gateway.stop()
        if sub.is_symlink():
            sub.unlink()
        else:
            shutil.rmtree(sub, ignore_errors=True)


def test_an_unmount_while_its_model_loads_waits_for_the_load(server, tiny_dir, tmp_path):
    """DELETE /v1/adapters/{id}?model=M while M is loading (held back by the parked engine,
    after its load read M's mount list) waits for the load, then unmounts from the loaded
    model: M then has no such adapter, nor has its list."""
    make_adapter(tiny_dir("qwen2"), tmp_path / "q", seed=7)
    url, gateway = server(
        adapter_root=str(tmp_path), model_adapters={"qwen": {"q": str(tmp_path / "q")}}
    )
    got = {}

    def delete():
        got["delete"] = httpx.delete(f"{url}/v1/adapters/q", params={"model": "qwen"}, timeout=120)

    release = hold_engine(gateway)
    try:
        asking = post_in_thread(url, {"model": "qwen", "prompt": "hi", "max_tokens": 2}, got, 0)
        assert wait_for(lambda: model_stats(url, "qwen")["state"] == "loading")
        time.sleep(0.5)  # the loader has read the list; it waits on the engine
        deleting = threading.Thread(target=delete)
        deleting.start()
        time.sleep(0.5)
        assert "delete" not in got  # it waits for the load
    finally:
        release.set()
    asking.join(120)
    deleting.join(120)
    assert got[0].status_code == 200, got[0].text
    assert got["delete"].status_code == 200, got["delete"].text
    assert got["delete"].json()["model"] == "qwen"
    assert httpx.get(f"{url}/v1/adapters", params={"model": "qwen"}).json()["adapters"] == []
    assert "q" not in gateway.models.entries["qwen"].mounts
    body = {"model": "qwen", "prompt": "hi", "max_tokens": 2, "adapter": "q"}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_adapter", r.text


def test_copies_of_a_model_share_one_tokenizer(tiny_dir, tmp_path):
    """tokenizers.shared_tokenizer: a model whose tokenizer files are a copy of a loaded one's
    (linked or copied; other files, a README, may differ) gets that model's tokenizer object (so
    its grammar vocabulary too, keyed by it), with the same encoding; other tokenizer files (a
    config, a chat template), or another model, get their own; once no model holds it, the next
    load builds a fresh one."""
    import gc

    from mlxlab import grammar
    from mlxlab.models import zoo

    # a tokenizer of this test's own (a key no other model has), so no model another test keeps
    # loaded (the session's served fixtures) holds it: the drop below is this test's alone
    src = tmp_path / "base"
    shutil.copytree(tiny_dir("gemma3"), src)
    conf = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**conf, "mlxlab_test": str(tmp_path)}))
    names = ("linked", "copied", "changed", "templated", "readme")
    linked, copied, changed, templated, readme = (tmp_path / n for n in names)
    linked.mkdir()
    for f in src.iterdir():
        (linked / f.name).symlink_to(f.resolve())
    for d in (copied, changed, templated, readme):
        shutil.copytree(src, d)
    conf = json.loads((changed / "tokenizer_config.json").read_text())
    (changed / "tokenizer_config.json").write_text(json.dumps({**conf, "model_max_length": 77}))
    (templated / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (readme / "README.md").write_text("# a copy with notes of its own\n")
    (readme / "image.png").write_bytes(b"\x89PNG not read by a tokenizer")
    model, tok = zoo.load(str(src))
    _, tok_linked = zoo.load(str(linked), pace=lambda fn=None: fn() if fn else None)
    _, tok_copied = zoo.load(str(copied))
    _, tok_readme = zoo.load(str(readme))
    _, tok_changed = zoo.load(str(changed))
    _, tok_templated = zoo.load(str(templated))
    _, tok_llama = zoo.load(str(tiny_dir("llama")))
    assert tok_linked is tok and tok_copied is tok and tok_readme is tok
    assert tok_changed is not tok and tok_llama is not tok
    assert tok_templated is not tok and tok_templated is not tok_changed
    assert tok_changed.encode("def main():") == tok.encode("def main():")
    n = model.args.vocab_size
    assert grammar.vocab_for(tok_copied, n) is grammar.vocab_for(tok, n)
    # every holder dropped: the next load builds another
    held = weakref.ref(tok)
    del tok, tok_linked, tok_copied, tok_readme
    gc.collect()
    assert held() is None
    _, fresh = zoo.load(str(copied))
    assert fresh is not None and fresh.encode("def main():") == tok_changed.encode("def main():")
