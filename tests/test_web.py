"""The browser pages' server side: train/runs.py (finding runs, confinement, incremental metrics
reads), the runs API and the pages on `python -m mlxlab runs`'s app and on `serve`'s (tiny-gemma3:
the runs directory defaults to the adapter root, a run's adapter mounts from its `mount_path`),
and the guard (pages open, every API call keyed, Host and Origin checks). The pages themselves
run in a real browser in tests/test_web_browser.py (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mlxlab.config import UserError
from mlxlab.serve.config import RunsConfig, ServeConfig
from mlxlab.serve.guard import is_page, load_keys
from mlxlab.serve.web import router as web
from mlxlab.serve.web.app import create_runs_app
from mlxlab.train import runs
from mlxlab.train.checkpoint import truncate_metrics
from tests.helpers.cli import REPO, run_cli
from tests.helpers.serve import BASE_URL, free_port, make_adapter, make_client

RECORDS = [
    {"step": 0, "val_loss": 6.9},
    {"step": 1, "loss": 7.0, "lr": 0.0, "grad_norm": 130.0, "tokens": 288},
    {"step": 2, "loss": 6.8, "lr": 1e-4, "tok_per_s": 100.0, "peak_mem_gb": 0.01},
]


def write_run(
    path: Path, records=RECORDS, finished=True, adapter=False, config=None, model="tiny-gemma3"
) -> Path:
    """A run directory in the layout `train` writes (train/job.py)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        f"name: t\nmodel: {model}\niters: 4\nobjective: sft\n" + (config or "")
    )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (path / "summary.json").write_text(json.dumps({"val_loss": 6.5, "wall_s": 3.0}))
    if adapter:
        (path / "adapter").mkdir()
        for name in runs.ADAPTER_FILES:
            (path / "adapter" / name).write_text("{}")
    return path


@pytest.fixture
def root(tmp_path):
    base = tmp_path / "outputs"
    write_run(base / "quickstart" / "20261201-000000", adapter=True)
    write_run(base / "dpo_run", finished=False, config="objective: dpo\n")
    (base / "quickstart" / "20261201-000000" / "checkpoints" / "step_1").mkdir(parents=True)
    write_run(base / ".hidden" / "r")
    (base / "not_a_run").mkdir()
    outside = write_run(tmp_path / "elsewhere" / "run")
    (base / "link").symlink_to(outside, target_is_directory=True)
    return base.resolve()


# --- train/runs.py ----------------------------------------------------------------------------


def test_find_lists_run_directories_only(root):
    found = [p.relative_to(root).as_posix() for p in runs.find(root)]
    # no hidden folder, no symlinked folder, nothing inside a run (checkpoints/, adapter/)
    assert sorted(found) == ["dpo_run", "quickstart/20261201-000000"]
    assert runs.find(root / "dpo_run") == [root / "dpo_run"]  # the root may be a run itself


@pytest.mark.parametrize(
    "run_id,status,code",
    [
        ("../elsewhere/run", 403, "outside_runs_dir"),
        ("quickstart/../../elsewhere/run", 403, "outside_runs_dir"),
        ("/etc", 403, "outside_runs_dir"),
        ("link", 403, "outside_runs_dir"),  # a symlink pointing out of the root
        ("nope", 404, "run_not_found"),
        ("not_a_run", 404, "run_not_found"),
        ("quickstart", 404, "run_not_found"),
        ("a\\..\\b", 404, "run_not_found"),
        ("a\x00b", 404, "run_not_found"),
        ("a" * 300, 404, "run_not_found"),  # longer than a file name may be
        ("x/\udcff", 404, "run_not_found"),
        ("", 404, "run_not_found"),
    ],
)
def test_run_ids_are_confined_to_the_root(root, run_id, status, code):
    with pytest.raises(runs.RunError) as e:
        runs.run_dir(root, run_id)
    assert (e.value.status, e.value.code) == (status, code)


def test_a_runs_file_linked_out_of_the_root_is_not_read(root, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"step": 1, "loss": 1.0, "password": 1}) + "\n")
    run = root / "dpo_run"
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(secret)
    assert runs.run_file(root, run, runs.METRICS) is None
    card = runs.describe(root, run)
    assert card["records"] == 0 and card["keys"] == []


def test_read_metrics_returns_complete_lines_from_an_offset(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + '\n{"step": 2, "lo')
    got = runs.read_metrics(path)
    assert [r["step"] for r in got["records"]] == [0, 1] and not got["reset"]
    assert got["offset"] == len(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n")
    # the line being written is finished, and more come, one of them not JSON, one NaN
    with path.open("a") as f:
        f.write('ss": NaN}\nnot json\n[1]\n' + json.dumps({"step": 3, "loss": 1.5}) + "\n")
    more = runs.read_metrics(path, got["offset"], got["file"])
    assert more["records"] == [{"step": 2, "loss": None}, {"step": 3, "loss": 1.5}]
    assert more["bad_lines"] == 2 and not more["reset"]
    assert more["offset"] == path.stat().st_size
    again = runs.read_metrics(path, more["offset"], more["file"])
    assert again["records"] == [] and again["offset"] == more["offset"]


def test_a_rewritten_file_is_read_again_from_its_start(tmp_path):
    """A resumed run drops the records after its checkpoint (the trainer's own function, an
    atomic rewrite): a reader at the old offset gets reset and the file's records."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    got = runs.read_metrics(path)
    truncate_metrics(path, 1)
    after = runs.read_metrics(path, got["offset"], got["file"])
    assert after["reset"] and [r["step"] for r in after["records"]] == [0, 1]
    assert after["file"] != got["file"]
    # shorter than the offset, same file: also read from the start
    path.write_text(json.dumps(RECORDS[0]) + "\n")
    os.truncate(path, path.stat().st_size)
    shrunk = runs.read_metrics(path, after["offset"] + 10, None)
    assert shrunk["reset"] and len(shrunk["records"]) == 1


def test_reads_come_in_chunks_and_skip_an_endless_line(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "MAX_CHUNK", 64)
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": i, "loss": 1.0 / (i + 1)}) for i in range(20)]
    path.write_text("\n".join(lines[:10]) + "\n" + "x" * 200 + "\n" + "\n".join(lines[10:]) + "\n")
    offset, ident, steps, rounds, bad = 0, None, [], 0, 0
    while True:
        got = runs.read_metrics(path, offset, ident)
        steps += [r["step"] for r in got["records"]]
        bad += got["bad_lines"]
        offset, ident, rounds = got["offset"], got["file"], rounds + 1
        if not got["more"]:
            break
    assert steps == list(range(20)) and rounds > 5 and bad >= 1


def test_describe_says_what_a_run_did_and_whether_it_still_runs(root):
    run = root / "quickstart" / "20261201-000000"
    card = runs.describe(root, run)
    assert card["id"] == "quickstart/20261201-000000" and card["status"] == "finished"
    assert (card["step"], card["records"], card["loss"], card["val_loss"]) == (2, 3, 6.8, 6.9)
    assert card["iters"] == 4 and card["model"] == "tiny-gemma3" and card["objective"] == "sft"
    assert {"loss", "val_loss", "lr", "tok_per_s", "peak_mem_gb"} <= set(card["keys"])
    assert card["adapter"] == str(run / "adapter")
    dpo = root / "dpo_run"
    assert runs.describe(root, dpo)["status"] == "running"
    assert runs.describe(root, dpo, now=time.time() + 3600)["status"] == "stopped"
    assert (
        runs.describe(root, dpo)["objective"] == "dpo"
        and runs.describe(root, dpo)["adapter"] is None
    )
    # a finished run that is resumed writes metrics after its summary: running again
    later = time.time() + 5
    os.utime(run / "metrics.jsonl", (later, later))
    assert runs.describe(root, run)["status"] == "running"


# --- the runs API and the pages (`mlxlab runs`'s app) ---------------------------------------


def runs_client(root: Path, **http) -> TestClient:
    cfg = ServeConfig(**http)
    return TestClient(create_runs_app(cfg, root, load_keys(cfg, environ={})), base_url=BASE_URL)


def test_the_runs_api_lists_plots_and_refuses_what_is_outside(root):
    c = runs_client(root)
    body = c.get("/v1/runs").json()
    assert body["root"] == str(root) and body["can_mount"] is False and body["model"] is None
    ids = [r["id"] for r in body["data"]]
    assert sorted(ids) == ["dpo_run", "quickstart/20261201-000000"]
    card = next(r for r in body["data"] if r["id"] == "quickstart/20261201-000000")
    assert card["adapter"] is True and card["mount_path"] is None  # no model here: no mounting
    m = c.get("/v1/runs/metrics", params={"run": "quickstart/20261201-000000"}).json()
    assert [r["step"] for r in m["records"]] == [0, 1, 2] and m["offset"] > 0
    with (root / "quickstart/20261201-000000/metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 6.7}) + "\n")
    m2 = c.get(
        "/v1/runs/metrics",
        params={"run": "quickstart/20261201-000000", "offset": m["offset"], "file": m["file"]},
    ).json()
    assert m2["records"] == [{"step": 3, "loss": 6.7}] and not m2["reset"]
    info = c.get("/v1/runs/info", params={"run": "quickstart/20261201-000000"}).json()
    assert info["config"]["model"] == "tiny-gemma3" and info["summary"]["val_loss"] == 6.5
    for bad, status, code in (
        ("../elsewhere/run", 403, "outside_runs_dir"),
        ("link", 403, "outside_runs_dir"),
        ("/etc", 403, "outside_runs_dir"),
        ("nope", 404, "run_not_found"),
    ):
        for path in ("/v1/runs/metrics", "/v1/runs/info"):
            r = c.get(path, params={"run": bad})
            assert r.status_code == status and r.json()["error"]["code"] == code, (bad, r.text)
            assert str(root.parent / "elsewhere") not in r.text
    r = c.get("/v1/runs/metrics")  # no run
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.run"
    r = c.get("/v1/runs/metrics", params={"run": "dpo_run", "offset": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.offset"


def test_a_run_without_metrics_yet_answers_an_empty_read(root):
    run = root / "starting"
    run.mkdir()
    (run / "config.yaml").write_text("model: tiny-gemma3\nwhen: 2026-12-01\n1: [.nan, .inf]\n")
    c = runs_client(root)
    m = c.get("/v1/runs/metrics", params={"run": "starting"}).json()
    assert m["records"] == [] and m["offset"] == 0 and m["file"] is None
    info = c.get("/v1/runs/info", params={"run": "starting"}).json()
    assert info["config"] == {"model": "tiny-gemma3", "when": "2026-12-01", "1": [None, None]}
    assert info["summary"] is None
    (run / "config.yaml").write_text("model: [unclosed\n")  # not YAML: no config, no error
    assert c.get("/v1/runs/info", params={"run": "starting"}).json()["config"] is None
    assert any(r["id"] == "starting" for r in c.get("/v1/runs").json()["data"])


def test_pages_load_without_the_key_and_every_call_needs_it(root):
    c = runs_client(root, api_key="sk-web")
    r = c.get("/runs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    # the page's own files are served, nothing else is
    for ref in re.findall(r'(?:src|href)="(/static/[^"]+)"', r.text):
        got = c.get(ref)
        assert got.status_code == 200, ref
    js = c.get("/static/runs.js")
    assert js.headers["content-type"].startswith("text/javascript")
    for path in ("/static/nope.js", "/static/%2e%2e", "/static/%2e%2e/app.py", "/static/x%2fy"):
        assert c.get(path).status_code in (401, 404), path
    # what clients do not normalize away still opens nothing but the files themselves
    assert is_page("/static/style.css") and is_page("/") and is_page("/runs")
    for path in ("/static/../v1/runs", "/static/a/b", "/runs/x", "/v1/runs", "/index.html"):
        assert not is_page(path), path
    r = c.get("/", follow_redirects=False)  # no model here: the chat redirects to the runs
    assert r.status_code == 307 and r.headers["location"] == "/runs"
    # the data needs the key
    for path in ("/v1/runs", "/v1/runs/metrics?run=dpo_run", "/v1/runs/info?run=dpo_run"):
        assert c.get(path).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer sk-web"}).status_code == 200
    # DNS rebinding: a foreign Host gets nothing, pages included
    assert c.get("/runs", headers={"Host": "evil.example"}).status_code == 403
    assert c.get("/static/runs.js", headers={"Host": "evil.example"}).status_code == 403


def test_every_served_page_file_is_shipped_and_referenced():
    files = web.static_files()
    assert {"index.html", "runs.html", "chat.js", "runs.js", "common.js", "style.css"} <= set(files)
    html = files["index.html"].read_text() + files["runs.html"].read_text()
    js = "".join(files[n].read_text() for n in files if n.endswith(".js"))
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html + js
    for name in (n for n in files if not n.endswith(".html")):  # nothing that no page loads
        assert f"/static/{name}" in html or f'"./{name}"' in js, name


def test_runs_config_errors_are_one_line():
    with pytest.raises(UserError, match="runs.dir is empty"):
        RunsConfig(dir=" ")
    with pytest.raises(UserError, match="port"):
        RunsConfig(port=0)
    with pytest.raises(UserError, match="runs.allowed_hosts"):  # checked as serve checks them
        RunsConfig(allowed_hosts=["a b"])
    with pytest.raises(UserError, match="runs.api_key"):
        RunsConfig(api_key="has space")


# --- on `serve` (tiny-gemma3) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_root(tiny_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("web_outputs")
    run = write_run(base / "quickstart" / "r1")
    make_adapter(tiny_dir("gemma3"), run / "adapter", seed=5)
    return base.resolve()


@pytest.fixture(scope="module")
def served(adapter_root):
    client, gateway = make_client(adapter_root=str(adapter_root), api_key="k1", admin_key="adm")
    yield client, gateway
    gateway.stop()


def test_serve_has_both_pages_and_lists_the_runs_under_the_adapter_root(served, adapter_root):
    c, _ = served
    page = c.get("/")
    assert page.status_code == 200 and "/static/chat.js" in page.text  # no key needed
    assert c.get("/runs").status_code == 200
    assert c.get("/v1/runs").status_code == 401
    body = c.get("/v1/runs", headers={"x-api-key": "k1"}).json()
    assert (
        body["root"] == str(adapter_root) and body["can_mount"] and body["model"] == "tiny-gemma3"
    )
    (card,) = body["data"]
    assert card["id"] == "quickstart/r1" and card["mount_path"] == "quickstart/r1/adapter"
    assert card["mounted_as"] == []


def test_a_run_mounts_from_its_mount_path_with_the_admin_key(served):
    c, _ = served
    card = c.get("/v1/runs", headers={"x-api-key": "k1"}).json()["data"][0]
    mount = {"id": "quickstart-r1", "path": card["mount_path"]}
    same_origin = {"Origin": BASE_URL, "Authorization": "Bearer k1"}
    r = c.post("/v1/adapters", json=mount, headers=same_origin)  # an API key: not enough
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    foreign = {"Origin": "http://evil.example", "Authorization": "Bearer adm"}
    r = c.post("/v1/adapters", json=mount, headers=foreign)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = c.post("/v1/adapters", json=mount, headers={**same_origin, "Authorization": "Bearer adm"})
    assert r.status_code == 200, r.text
    try:
        card = c.get("/v1/runs", headers={"x-api-key": "k1"}).json()["data"][0]
        assert card["mounted_as"] == ["quickstart-r1"]
        chat = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "adapter": "quickstart-r1",
            },
            headers={"x-api-key": "k1"},
        )
        assert chat.status_code == 200
    finally:
        c.delete("/v1/adapters/quickstart-r1", headers={"x-api-key": "adm"})


def test_runs_outside_the_adapter_root_are_listed_but_not_mountable(served, root):
    _, gateway = served
    c, _ = make_client(gateway, runs_dir=str(root))
    body = c.get("/v1/runs").json()
    assert body["root"] == str(root)
    card = next(r for r in body["data"] if r["id"] == "quickstart/20261201-000000")
    assert card["adapter"] is True and card["mount_path"] is None


def test_a_run_config_of_another_shape_does_not_break_the_listing(served, tmp_path):
    """A run whose config.yaml `model` is not a model name (a list, a mapping, a number, a
    string no file system takes) is listed, to be mounted on the default."""
    _, gateway = served
    base = tmp_path / "outputs"
    for name, model in (("list", "[1, 2]"), ("map", "{a: 1}"), ("int", "5"), ("long", "x" * 5000)):
        write_run(base / name, adapter=True, model=model)
    c, _ = make_client(gateway, runs_dir=str(base))
    r = c.get("/v1/runs")
    assert r.status_code == 200, r.text
    cards = {card["id"]: card for card in r.json()["data"]}
    assert set(cards) == {"list", "map", "int", "long"}
    for card in cards.values():
        assert card["mount_model"] == "tiny-gemma3" and card["model_served"] is False


def test_listing_runs_changes_no_model(tiny_dir, tmp_path, monkeypatch):
    """With models_from_cache, a run trained from a cache model not asked for yet is shown to
    mount on it, and listing the runs adds no model to the server's (/stats)."""
    from tests.helpers.hub import write_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_cache(tmp_path / "hub", "tiny-org/llama", tiny_dir("llama"))
    base = tmp_path / "outputs"
    write_run(base / "r", adapter=True, model="tiny-org/llama")
    c, gateway = make_client(models_from_cache=True, runs_dir=str(base))
    try:
        before = [m["id"] for m in c.get("/stats").json()["models"]["models"]]
        (card,) = c.get("/v1/runs").json()["data"]
        assert card["mount_model"] == "tiny-org/llama" and card["model_served"] is True
        assert [m["id"] for m in c.get("/stats").json()["models"]["models"]] == before
        assert "tiny-org/llama" not in gateway.models.entries
    finally:
        gateway.stop()


def test_a_run_mounts_on_the_served_model_it_trained_from(tiny_dir, tmp_path, monkeypatch):
    """With several models, a run's card says which model the page mounts its adapter on: the
    served model its config's `model` names (a served name or spec, or the same directory),
    else the default; where the default cannot take it, the mount is a 400 naming both."""
    base = tmp_path / "outputs"
    for name, model, family in (
        ("on_small", "tiny-llama", "llama"),
        ("by_dir", str(tiny_dir("llama")), "llama"),
        ("on_default", "tiny-gemma3", "gemma3"),
        ("unserved", "tiny-qwen2", "qwen2"),
        ("mislabeled", "tiny-llama", "gemma3"),  # its config names small's model: it is not
    ):
        run = write_run(base / name, model=model)
        make_adapter(tiny_dir(family), run / "adapter", seed=6)
    c, gateway = make_client(
        models={"small": "tiny-llama"},
        adapter_root=str(base.resolve()),
        model_adapters={"small": {"boot": str(base / "on_small")}},  # its run directory
    )
    try:
        cards = {card["id"]: card for card in c.get("/v1/runs").json()["data"]}
        # a start-up mount of a model not loaded: known by its (resolved) adapter path
        assert gateway.models.entries["small"].state == "unloaded"
        assert cards["on_small"]["mounted_as"] == ["boot"]
        assert {i: (x["mount_model"], x["model_served"]) for i, x in cards.items()} == {
            "on_small": ("small", True),
            "by_dir": ("small", True),
            "on_default": ("tiny-gemma3", True),
            "unserved": ("tiny-gemma3", False),
            "mislabeled": ("small", True),
        }
        # the page's mount: {id, path: mount_path, model: mount_model}
        for i in ("on_small", "by_dir", "on_default"):
            mount = {"id": i, "path": cards[i]["mount_path"], "model": cards[i]["mount_model"]}
            r = c.post("/v1/adapters", json=mount)
            assert r.status_code == 200 and r.json()["model"] == cards[i]["mount_model"], r.text
        cards = {card["id"]: card for card in c.get("/v1/runs").json()["data"]}
        assert [cards[i]["mounted_as"] for i in ("on_small", "by_dir", "on_default")] == [
            ["boot", "on_small"],
            ["by_dir"],
            ["on_default"],
        ]
        body = {"prompt": "hi", "max_tokens": 2, "model": "small", "adapter": "on_small"}
        assert c.post("/v1/completions", json=body).status_code == 200
        # not served, and the default cannot take it: a 400 naming both
        mount = {"id": "unserved", "path": cards["unserved"]["mount_path"]}
        r = c.post("/v1/adapters", json={**mount, "model": cards["unserved"]["mount_model"]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "adapter_model_mismatch", r.text
        assert "'tiny-gemma3'" in err["message"] and "'tiny-qwen2'" in err["message"]
        assert "not served here" in err["message"]
        # served elsewhere: the refusal says where
        mount = {"id": "x", "path": cards["on_small"]["mount_path"]}  # on the default
        r = c.post("/v1/adapters", json=mount)
        assert r.status_code == 400, r.text
        assert "served here as 'small'" in r.json()["error"]["message"]
        # trained from the very model it is refused on (its files say otherwise): no hint
        mount = {"id": "m", "path": cards["mislabeled"]["mount_path"], "model": "small"}
        r = c.post("/v1/adapters", json=mount)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "adapter_model_mismatch", r.text
        assert "served here" not in err["message"] and "trained from" not in err["message"]
        # a hint that fails is no hint, not a 500
        from mlxlab.serve.admin import router as admin

        def boom(path):
            raise OSError("unreadable")

        monkeypatch.setattr(admin.runs, "trained_from", boom)
        r = c.post("/v1/adapters", json={**mount, "path": cards["unserved"]["mount_path"]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "adapter_model_mismatch", r.text
        assert "trained from" not in err["message"]
    finally:
        gateway.stop()


# --- the command --------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess
def test_the_runs_command_serves_the_page_on_its_own(root):
    r = run_cli("runs", f"dir={root}/missing")
    assert r.returncode == 1 and "no such directory" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxlab", "runs", f"dir={root}", f"port={port}", "api_key=sk-r"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/runs" in line and "2 runs under" in line, line
        import httpx

        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                page = httpx.get(base + "/runs")
                break
            except httpx.ConnectError:
                assert time.time() < deadline
                time.sleep(0.2)
        assert page.status_code == 200
        assert httpx.get(base + "/v1/runs").status_code == 401
        got = httpx.get(base + "/v1/runs", headers={"Authorization": "Bearer sk-r"}).json()
        assert len(got["data"]) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
