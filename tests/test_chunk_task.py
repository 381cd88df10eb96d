"""The chunk task's data builder and scorer (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxlab.config import ChunkDataConfig
from mlxlab.data import chunk as data
from mlxlab.eval import chunk as ev

U = [
    "aaaaaaaa-0000-4000-8000-000000000000",
    "bbbbbbbb-1111-4000-8000-000000000000",
    "cccccccc-2222-4000-8000-000000000000",
    "dddddddd-3333-4000-8000-000000000000",
]
GOLD = [
    {"start_message_uuid": U[0], "end_message_uuid": U[1], "label": "The assert statement"},
    {
        "start_message_uuid": U[2],
        "end_message_uuid": U[3],
        "label": "Augmented assignment statements",
    },
]


def test_builder_is_deterministic_and_keeps_topics_apart():
    cfg = ChunkDataConfig(seed=1, train=20, valid=5, test=5)
    a, b = data.build(cfg), data.build(cfg)
    assert a == b
    labels = {split: {c["label"] for ex in rows for c in ex["chunks"]} for split, rows in a.items()}
    assert not labels["train"] & labels["test"] and not labels["train"] & labels["valid"]
    ex = a["train"][0]
    assert (
        len(ex["chunks"]) >= 2
        and ex["chunks"][0]["start_message_uuid"] == ex["messages"][0]["uuid"]
    )
    chat = data.to_chat(ex)
    assert json.loads(chat["messages"][-1]["content"])["chunks"] == ex["chunks"]
    assert (
        "(uuid: " in chat["messages"][1]["content"] and "\n---\n" in chat["messages"][1]["content"]
    )
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
    chunks = [
        {
            "start_message_uuid": "aaaaaaaa-0000",
            "end_message_uuid": U[1],
            "label": "Assert statements",
        },
        {"start_message_uuid": U[2], "end_message_uuid": U[2], "label": "Augmented assignment"},
    ]
    s = ev.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2  # prefix match + trailing gap
    assert s.anchors == pytest.approx(1 - 2 / 4)
    assert s.wellformed == pytest.approx(100 * (0.30 + 0.35 * 0.5 + 0.15 + 0.20))
    assert s.boundary_f1 == 1.0 and s.exact_match == 1.0  # the covered gap restores the span


def test_inverted_and_unknown_uuids_are_repaired():
    chunks = [
        {"start_message_uuid": U[1], "end_message_uuid": U[0], "label": "Assert statements"},
        {"start_message_uuid": U[2], "end_message_uuid": "nope", "label": "Chunk 2"},
    ]
    s = ev.score_case(json.dumps({"chunks": chunks}), U, GOLD)
    assert s.repairs == 2 and s.labels == 0.5 and s.exact_match == 1.0


def test_unrepairable_results_score_zero_anchors():
    overlap = [
        {"start_message_uuid": U[0], "end_message_uuid": U[2], "label": "Assert statements"},
        {"start_message_uuid": U[1], "end_message_uuid": U[3], "label": "Augmented assignment"},
    ]
    s = ev.score_case(json.dumps({"chunks": overlap}), U, GOLD)
    assert s.anchors == 0.0 and s.boundary_f1 == 0.0
    assert ev.score_case("no json here", U, GOLD).wellformed == 0.0
    assert ev.score_case(json.dumps({"chunks": []}), U, GOLD).wellformed == pytest.approx(30.0 * 0)
    bad_schema = ev.score_case(json.dumps({"chunks": [{"start_message_uuid": 3}]}), U, GOLD)
    assert bad_schema.schema == 0.0 and bad_schema.nonempty == 1.0


def test_generic_labels():
    assert not ev.is_specific("Chunk 1") and not ev.is_specific("Other topics")
    assert not ev.is_specific("Assert") and ev.is_specific("The assert statement")
    summary = ev.summarize(
        [
            ev.score_case(json.dumps({"chunks": GOLD}), U, GOLD).to_dict(),
            ev.score_case("nothing", U, GOLD).to_dict(),
        ]
    )
    assert summary["cases"] == 2 and summary["wellformed"] == 50.0


def test_written_splits_feed_training_and_eval(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.config import DataConfig
    from mlxlab.data.datasets import load_split

    out = data.write_jsonl(tmp_path / "chunk", ChunkDataConfig(train=6, valid=2, test=3))
    assert sorted(p.name for p in out.iterdir()) == [
        "build.json",
        "test.jsonl",
        "train.jsonl",
        "valid.jsonl",
    ]
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
    assert (
        again.returncode == 1 and "force=true" in again.stderr and "Traceback" not in again.stderr
    )
    bad = run_cli(
        "data", "chunk", f"out={tmp_path / 'x'}", "chunk.min_topics=5", "chunk.max_topics=2"
    )
    assert bad.returncode == 1 and "min_topics" in bad.stderr
    res = tmp_path / "res.jsonl"
    ev_run = run_cli(
        "eval",
        "chunk",
        "model=tiny-gemma3",
        f"data={out}",
        "max_tokens=6",
        "batch_size=2",
        f"out={res}",
    )
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
    cfg = compose(
        "train",
        [
            "model=tiny-gemma3",
            "task.name=chunk",
            "task.data.train=6",
            "task.data.valid=2",
            "task.data.test=3",
            "task.eval.max_tokens=6",
            "task.eval.constrained=true",
            "iters=2",
            "batch_size=2",
            "val_every=0",
            "wandb=disabled",
            f"out_dir={tmp_path / 'run'}",
            f"task.report={report}",
        ],
    )
    summary = cli.run(cfg)
    run_dir = tmp_path / "run"
    assert set(summary["eval"]) == {"base", "tuned"} and summary["eval"]["tuned"]["cases"] == 3
    for name in ("eval_base.jsonl", "eval_tuned.jsonl", "README.md", "data/train.jsonl"):
        assert (run_dir / name).is_file(), name
    text = report.read_text()
    assert (
        "| base | 3 |" in text
        and "| tuned | 3 |" in text
        and "peak memory" in text
        and "wall time" in text
    )
    assert "| base, constrained | 3 |" in text and "| tuned, constrained | 3 |" in text
    assert (run_dir / "eval_tuned.constrained.jsonl").is_file()
    # A run directory stands for its final adapter, never a checkpoint.
    assert lora_io.resolve_dir(run_dir) == run_dir / "adapter"
    (run_dir / "adapter" / "adapter_config.json").unlink()
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    with pytest.raises(Exception, match="without a final adapter"):
        lora_io.resolve_dir(run_dir)


def test_answer_schema_accepts_the_gold_answer():
    import jsonschema

    schema = ev.answer_schema(U)
    jsonschema.validate({"chunks": GOLD}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"chunks": [{**GOLD[0], "end_message_uuid": "eeeeeeee-4444"}]}, schema)
    assert ev.constrained_path(Path("x/eval_base.jsonl")).name == "eval_base.constrained.jsonl"


def _tiny_chunk_cases(tiny_dir, tmp_path, n: int):
    """n short test conversations (two topics of one message) and the tiny Gemma 3."""
    from mlx_lm.utils import load

    cfg = ChunkDataConfig(
        train=2, valid=1, test=n, min_topics=2, max_topics=2, min_messages=1, max_messages=1
    )
    out = data.write_jsonl(tmp_path / "chunk", cfg)
    records = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    model, tokenizer = load(str(tiny_dir("gemma3")))
    return model, tokenizer, records


@pytest.mark.parametrize("batch_size", [2, 1])
def test_constrained_eval_parses_and_uses_only_the_conversations_uuids(
    tiny_dir, tmp_path, batch_size
):
    """A random tiny model writes garbage unconstrained; under the answer schema every output is
    the answer's JSON with this conversation's uuids, on the batched and the one-by-one path."""
    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, batch_size)
    free = ev.evaluate(model, tokenizer, records, max_tokens=48, batch_size=batch_size)
    assert all(r["extraction"] == "none" and r["schema"] == 0.0 for r in free)
    held = ev.evaluate(
        model, tokenizer, records, max_tokens=1024, batch_size=batch_size, constrained=True
    )
    for row, record in zip(held, records, strict=True):
        _, uuids, _ = data.case_from_chat(record)
        answer = json.loads(row["output"])  # the whole text, no extraction needed
        assert row["extraction"] == "raw" and list(answer) == ["chunks"] and row["schema"] == 1.0
        assert 1 <= len(answer["chunks"]) <= len(uuids)
        for chunk in answer["chunks"]:
            assert list(chunk) == ["start_message_uuid", "end_message_uuid", "label"]
            assert chunk["start_message_uuid"] in uuids and chunk["end_message_uuid"] in uuids
            assert isinstance(chunk["label"], str) and 1 <= len(chunk["label"]) <= ev.LABEL_CHARS


def test_constrained_eval_is_reported_next_to_the_unconstrained_one(tiny_dir, tmp_path):
    from mlxlab.config import EvalSettings

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 2)
    settings = EvalSettings(max_tokens=8, batch_size=2, constrained=True)
    summary = ev.evaluate_model(model, tokenizer, records, settings, tmp_path / "res.jsonl", "tiny")
    held = tmp_path / "res.constrained.jsonl"
    assert summary["constrained"]["results"] == str(held) and summary["results"] == str(
        tmp_path / "res.jsonl"
    )
    assert len(held.read_text().splitlines()) == 2 and summary["constrained"]["cases"] == 2
    head = '{"chunks": [{"start_message_uuid": "'
    for line in held.read_text().splitlines():  # 8 tokens: the schema's opening, or part of it
        output = json.loads(line)["output"]
        assert output and (head.startswith(output) or output.startswith(head)), output
    text = ev.table({"tiny": summary})
    assert "| tiny | 2 |" in text and "| tiny, constrained | 2 | " in text
    assert text.index("| tiny | 2 |") < text.index("| tiny, constrained |")
    assert "constrained" not in ev.evaluate_model(
        model, tokenizer, records, EvalSettings(max_tokens=2), tmp_path / "plain.jsonl", "tiny"
    )
