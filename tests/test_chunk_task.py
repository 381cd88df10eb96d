"""The chunk task's data builder and scorer (no model needed)."""

from __future__ import annotations

import json

import pytest

from mlxlab.config import ChunkDataConfig
from mlxlab.data import chunk as data
from mlxlab.eval import chunk as ev

U = ["aaaaaaaa-0000-4000-8000-000000000000", "bbbbbbbb-1111-4000-8000-000000000000",
     "cccccccc-2222-4000-8000-000000000000", "dddddddd-3333-4000-8000-000000000000"]
GOLD = [{"start_message_uuid": U[0], "end_message_uuid": U[1], "label": "The assert statement"},
        {"start_message_uuid": U[2], "end_message_uuid": U[3], "label": "Augmented assignment statements"}]


def test_builder_is_deterministic_and_keeps_topics_apart():
    cfg = ChunkDataConfig(seed=1, train=20, valid=5, test=5)
    a, b = data.build(cfg), data.build(cfg)
    assert a == b
    labels = {split: {c["label"] for ex in rows for c in ex["chunks"]} for split, rows in a.items()}
    assert not labels["train"] & labels["test"] and not labels["train"] & labels["valid"]
    ex = a["train"][0]
    assert len(ex["chunks"]) >= 2 and ex["chunks"][0]["start_message_uuid"] == ex["messages"][0]["uuid"]
    chat = data.to_chat(ex)
    assert json.loads(chat["messages"][-1]["content"])["chunks"] == ex["chunks"]
    assert "(uuid: " in chat["messages"][1]["content"] and "\n---\n" in chat["messages"][1]["content"]
    assert data.build(ChunkDataConfig(seed=2, train=5))["train"] != a["train"][:5]
    for ex in a["train"]:
        assert 2 <= len(ex["chunks"]) <= 3 and len(data.render(ex["messages"])) <= cfg.max_chars
        assert all(len(m["text"]) <= cfg.max_paragraph_chars for m in ex["messages"])


def test_gold_answer_scores_perfectly():
    s = ev.score_case(json.dumps({"chunks": GOLD}), U, GOLD)
    assert (s.wellformed, s.boundary_f1, s.exact_match, s.repairs) == (100.0, 1.0, 1.0, 0)


@pytest.mark.parametrize("wrap", ["```json\n{}\n```", "Sure! Here it is: {} Hope that helps."])
def test_extraction_fallbacks(wrap):
    text = wrap.replace("{}", json.dumps({"chunks": GOLD}))
    s = ev.score_case(text, U, GOLD)
    assert s.wellformed == 100.0 and s.extraction in ("fence", "braces")


def test_repairs_cost_anchor_points():
    chunks = [{"start_message_uuid": "aaaaaaaa-0000", "end_message_uuid": U[1], "label": "Assert statements"},
              {"start_message_uuid": U[2], "end_message_uuid": U[2], "label": "Augmented assignment"}]
    s = ev.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2  # prefix match + trailing gap
    assert s.anchors == pytest.approx(1 - 2 / 4)
    assert s.wellformed == pytest.approx(100 * (0.30 + 0.35 * 0.5 + 0.15 + 0.20))
    assert s.boundary_f1 == 1.0 and s.exact_match == 1.0  # the covered gap restores the span


def test_inverted_and_unknown_uuids_are_repaired():
    chunks = [{"start_message_uuid": U[1], "end_message_uuid": U[0], "label": "Assert statements"},
              {"start_message_uuid": U[2], "end_message_uuid": "nope", "label": "Chunk 2"}]
    s = ev.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2 and s.labels == 0.5 and s.exact_match == 1.0


def test_unrepairable_results_score_zero_anchors():
    overlap = [{"start_message_uuid": U[0], "end_message_uuid": U[2], "label": "Assert statements"},
               {"start_message_uuid": U[1], "end_message_uuid": U[3], "label": "Augmented assignment"}]
    s = ev.score_case(json.dumps({"chunks": overlap}), U, GOLD)
    assert s.anchors == 0.0 and s.boundary_f1 == 0.0
    assert ev.score_case("no json here", U, GOLD).wellformed == 0.0
    assert ev.score_case(json.dumps({"chunks": []}), U, GOLD).wellformed == pytest.approx(30.0 * 0)
    bad_schema = ev.score_case(json.dumps({"chunks": [{"start_message_uuid": 3}]}), U, GOLD)
    assert bad_schema.schema == 0.0 and bad_schema.nonempty == 1.0


def test_generic_labels():
    assert not ev.is_specific("Chunk 1") and not ev.is_specific("Other topics")
    assert not ev.is_specific("Assert") and ev.is_specific("The assert statement")
    summary = ev.summarize([ev.score_case(json.dumps({"chunks": GOLD}), U, GOLD).to_dict(),
                            ev.score_case("nothing", U, GOLD).to_dict()])
    assert summary["cases"] == 2 and summary["wellformed"] == 50.0


def test_written_splits_feed_training_and_eval(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.config import DataConfig
    from mlxlab.data.datasets import load_split

    out = data.write_jsonl(tmp_path / "chunk", ChunkDataConfig(train=6, valid=2, test=3))
    assert sorted(p.name for p in out.iterdir()) == ["build.json", "test.jsonl", "train.jsonl", "valid.jsonl"]
    model, tokenizer = load(str(tiny_dir("gemma3")))
    split = load_split(out / "train.jsonl", tokenizer, DataConfig(max_seq_length=4096))
    assert len(split.examples) == 6 and all(e.offset > 0 for e in split.examples)
    records = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    _, uuids, gold = data.case_from_chat(records[0])
    assert uuids[0] == gold[0]["start_message_uuid"] and uuids[-1] == gold[-1]["end_message_uuid"]
    results = ev.evaluate(model, tokenizer, records, max_tokens=8, batch_size=2)
    assert len(results) == 3 and all(0.0 <= r["wellformed"] <= 100.0 for r in results)
    assert [r["case"] for r in results] == [0, 1, 2]
    one_by_one = ev.evaluate(model, tokenizer, records, max_tokens=8, batch_size=1)
    assert [r["prompt_tokens"] for r in one_by_one] == [r["prompt_tokens"] for r in results]


@pytest.mark.slow  # CLI subprocesses
def test_data_and_eval_commands(tiny_dir, tmp_path):
    from tests.helpers.cli import run_cli

    tiny_dir("gemma3")
    out = tmp_path / "chunk"
    r = run_cli("data", "chunk", f"out={out}", "chunk.train=5", "chunk.valid=2", "chunk.test=3")
    assert r.returncode == 0, r.stderr
    assert "train: 5 conversations" in r.stdout and (out / "test.jsonl").is_file()
    assert json.loads((out / "build.json").read_text())["train"] == 5
    again = run_cli("data", "chunk", f"out={out}")
    assert again.returncode == 1 and "force=true" in again.stderr and "Traceback" not in again.stderr
    bad = run_cli("data", "chunk", f"out={tmp_path / 'x'}", "chunk.min_topics=5", "chunk.max_topics=2")
    assert bad.returncode == 1 and "min_topics" in bad.stderr
    res = tmp_path / "res.jsonl"
    ev_run = run_cli("eval", "chunk", "model=tiny-gemma3", f"data={out}", "max_tokens=6", "batch_size=2",
                     f"out={res}")
    assert ev_run.returncode == 0, ev_run.stderr
    assert "| tiny-gemma3 | 3 |" in ev_run.stdout
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert len(rows) == 3 and {"wellformed", "boundary_f1", "exact_match", "output"} <= set(rows[0])
    missing = run_cli("eval", "chunk", "model=tiny-gemma3", f"data={tmp_path}")
    assert missing.returncode == 1 and "no test.jsonl" in missing.stderr


@pytest.mark.slow  # end to end: data, base eval, training, tuned eval, report
def test_task_run_trains_evaluates_and_reports(tiny_dir, tmp_path):
    from mlxlab.cli import compose
    from mlxlab.lora import io as lora_io
    from mlxlab.train import cli

    tiny_dir("gemma3")
    report = tmp_path / "exp" / "README.md"
    cfg = compose("train", ["model=tiny-gemma3", "task.name=chunk", "task.data.train=6", "task.data.valid=2",
                            "task.data.test=3", "task.eval.max_tokens=6", "iters=2", "batch_size=2",
                            "val_every=0", "wandb=disabled", f"out_dir={tmp_path / 'run'}",
                            f"task.report={report}"])
    summary = cli.run(cfg)
    run_dir = tmp_path / "run"
    assert set(summary["eval"]) == {"base", "tuned"} and summary["eval"]["tuned"]["cases"] == 3
    for name in ("eval_base.jsonl", "eval_tuned.jsonl", "README.md", "data/train.jsonl"):
        assert (run_dir / name).is_file(), name
    text = report.read_text()
    assert "| base | 3 |" in text and "| tuned | 3 |" in text and "peak memory" in text and "wall time" in text
    # A run directory stands for its final adapter, never a checkpoint.
    assert lora_io.resolve_dir(run_dir) == run_dir / "adapter"
    (run_dir / "adapter" / "adapter_config.json").unlink()
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    with pytest.raises(Exception, match="without a final adapter"):
        lora_io.resolve_dir(run_dir)
