"""The chunk preference task (mlxlab/tasks/chunk/pref.py): pairs from an SFT run's training
windows, DPO/ORPO on top of its adapter, SFT alone against SFT + preference."""

from __future__ import annotations

import json
import random

import pytest

from mlxlab.config import UserError
from mlxlab.tasks.chunk import pref
from mlxlab.tasks.chunk import pref as cp
from mlxlab.tasks.chunk import prompt as pr
from mlxlab.tasks.chunk.config import ChunkPrefConfig

U = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(6)]


def _gold(*spans):
    return [
        {"start_message_uuid": U[s], "end_message_uuid": U[e], "label": f"Topic number {k}"}
        for k, (s, e) in enumerate(spans)
    ]


def test_moved_boundary_moves_one_boundary_by_one_message():
    gold = _gold((0, 2), (3, 5))
    seen = set()
    for seed in range(20):
        moved = pref.moved_boundary(gold, U, random.Random(seed))
        ends = [(U.index(c["start_message_uuid"]), U.index(c["end_message_uuid"])) for c in moved]
        assert ends in ([(0, 1), (2, 5)], [(0, 3), (4, 5)])
        assert [c["label"] for c in moved] == [c["label"] for c in gold]
        seen.add(tuple(ends))
    assert len(seen) == 2  # both directions happen
    assert pref.moved_boundary(_gold((0, 5)), U, random.Random(0)) is None  # one chunk
    # one-message chunks only give a message where they keep one
    moved = pref.moved_boundary(_gold((0, 0), (1, 5)), U, random.Random(0))
    assert [U.index(c["end_message_uuid"]) for c in moved] == [1, 5]


def test_pick_takes_the_multi_chunk_share_first():
    windows = [("c", [], _gold((0, 5)))] * 10 + [("c", [], _gold((0, 2), (3, 5)))] * 4
    picked = cp.pick(windows, 8, 0.75, random.Random(0))
    assert len(picked) == 8 and sum(len(w[2]) >= 2 for w in picked) == 4  # all there are
    assert sum(len(w[2]) >= 2 for w in cp.pick(windows, 4, 0.5, random.Random(0))) == 2


def test_a_right_answer_is_the_gold_with_full_marks():
    gold = _gold((0, 2), (3, 5))
    assert cp.is_right(pr.answer(gold), U, gold, None)
    assert not cp.is_right(pr.answer(_gold((0, 5))), U, gold, None)  # one chunk
    assert not cp.is_right(pr.answer(pref.moved_boundary(gold, U, random.Random(1))), U, gold, None)
    generic = [{**c, "label": "discussion"} for c in gold]
    assert not cp.is_right(pr.answer(generic), U, gold, None)  # ref takes label points
    assert not cp.is_right("no json", U, gold, None)


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="no finished chunk SFT run"):
        cp.find_sft_run(tmp_path)
    with pytest.raises(UserError, match="not a finished chunk-task run"):
        cp.sft_dir(ChunkPrefConfig(sft=str(tmp_path)))
    with pytest.raises(UserError, match="multi_share"):
        ChunkPrefConfig(multi_share=2)
    from mlxlab.train.config import TrainConfig

    with pytest.raises(UserError, match="objective=dpo, objective=orpo or objective=grpo"):
        cp.ChunkPrefTask(ChunkPrefConfig()).train_config(TrainConfig())


def test_grpo_trains_from_the_sft_adapter_and_warns_without_a_chunk_reward(tmp_path, caplog):
    import dataclasses

    from mlxlab.train.config import GRPOConfig, TrainConfig

    sft = tmp_path / "sft"
    (sft / "adapter").mkdir(parents=True)
    (sft / "data").mkdir()
    (sft / "data" / "train.cases.json").write_text("[]")
    (sft / "data" / "build.json").write_text("{}")
    task = cp.ChunkPrefTask(ChunkPrefConfig(sft=str(sft)))
    grpo = TrainConfig(objective="grpo")
    with caplog.at_level("WARNING"):
        assert task.train_config(grpo).lora.init == str(sft)
    assert "without a chunk reward" in caplog.text
    caplog.clear()
    chunk = GRPOConfig(rewards=["mlxlab.tasks.chunk.reward:chunk_reward"])
    with caplog.at_level("WARNING"):
        task.train_config(dataclasses.replace(grpo, grpo=chunk))
    assert "without a chunk reward" not in caplog.text
    # every split the evaluation may read comes along with the training windows
    (sft / "data" / "dev.cases.json").write_text("[]")
    (tmp_path / "copy").mkdir()
    task._copy_sft_data(tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == [
        "build.json",
        "dev.cases.json",
        "train.cases.json",
    ]


def test_the_data_settings_are_read_from_a_build_json_with_a_sources_report():
    """A build.json holds the sharegpt source's report under the `sharegpt` setting's name:
    the windows' settings are read from it all the same."""
    build = {
        "sharegpt": {"file": "x.json", "steps": {}},
        "train": 100,
        "window_chars": 3600,
        "window_overlap": 2,
        "window_messages": 4,
    }
    cfg = pref._data_config(build)
    assert (cfg.window_chars, cfg.window_overlap, cfg.window_messages) == (3600, 2, 4)
    assert pref._data_config({"window_chars": 3000}).window_messages == 1000  # before the cap


COMMON = [
    "model=tiny-gemma3",
    "task.eval.max_tokens=6",
    "task.eval.max_prompt_tokens=8192",
    "data.max_seq_length=8192",  # the tiny tokenizer takes ~1.4 characters a token
    "lora.rank=4",
    "iters=2",
    "val_every=0",
    "wandb=disabled",
]


def _sft_run(tmp_path):
    """A finished chunk SFT task run of tiny-gemma3 (8 training conversations of two topics)."""
    from mlxlab.cli import compose
    from mlxlab.train import cli

    sft = tmp_path / "sft"
    cli.run(
        compose(
            "train",
            [
                *COMMON,
                "task.name=chunk",
                "task.eval_base=false",
                "task.data.train=8",
                "task.data.valid=1",
                "task.data.test=3",
                "task.data.train_topic_weights=[0,1]",
                "batch_size=2",
                f"out_dir={sft}",
            ],
        )
    )
    return sft


@pytest.mark.slow  # end to end: an SFT task run, then DPO on top of it (pairs, training, eval)
@pytest.mark.parametrize("turns", [False, True])
def test_preference_run_on_top_of_a_chunk_sft_run(tiny_dir, tmp_path, turns):
    from pathlib import Path

    from mlxlab.cli import compose
    from mlxlab.train import cli

    tiny_dir("gemma3")
    common = COMMON
    sft = _sft_run(tmp_path)
    # `eval chunk adapter=<sft run>` reads the windows the run trained on
    from mlxlab.tasks.chunk import cli as eval_cli

    ecfg = compose(
        "eval",
        ["model=tiny-gemma3", f"adapter={sft}", "cases=1", "max_tokens=4", f"out={tmp_path / 'e'}"],
    )
    eval_cli.evaluate(ecfg)
    assert ecfg.window_messages == 4
    report = tmp_path / "exp" / "README.md"
    summary = cli.run(
        compose(
            "train",
            [
                *common,
                "task.name=chunk_pref",
                f"task.sft={sft}",
                "task.examples=4",
                "objective=dpo",
                "batch_size=1",
                f"out_dir={tmp_path / 'dpo'}",
                f"task.report={report}",
            ],
        )
    )
    run = tmp_path / "dpo"
    pairs = json.loads((run / "data" / "pairs.json").read_text())
    assert pairs["examples"] == 4 and pairs["multi_chunk_examples"] == 3
    assert pairs["pairs_moved"] == 3 and pairs["pairs"] == pairs["pairs_sampled"] + 3
    lines = (run / "data" / "train.jsonl").read_text().splitlines()
    assert len(lines) == pairs["pairs"]
    for line in lines:
        p = json.loads(line)
        chosen = json.loads(p["chosen"])
        gold = chosen["chunks"]
        assert list(gold[0]) == list(pr.KEYS) and p["rejected"] != p["chosen"]
        assert p["messages"][0]["content"].startswith(pr.INSTRUCTIONS)
    # SFT alone is the SFT run's own evaluation (same data, same settings), not a new one
    assert (run / "eval_sft.jsonl").read_bytes() == (sft / "eval_tuned.jsonl").read_bytes()
    assert set(summary["eval"]) == {"sft", "sft + dpo"}
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in steps if "loss" in r)
    assert first["reward_margin"] == 0.0  # DPO's reference is the SFT adapter it starts from
    text = report.read_text()
    assert "| sft | 3 |" in text and "| sft + dpo | 3 |" in text and str(sft) in text
    assert Path(summary["adapter"]).is_dir()


def test_sft_evaluation_is_reused_only_with_the_same_decode(tmp_path):
    """SFT alone is copied from the SFT run only when its evaluation settings match: a run from
    before eval.cover decoded its constrained row under a JSON schema, one from before
    eval.read_overruled read the windows the grammar overruled, and one with an option since
    retired set otherwise than this code decodes (cover true, split_bias) decoded otherwise;
    one with the retired options at the values this code has fixed is reused."""
    import yaml

    from mlxlab.config import to_dict
    from mlxlab.tasks.chunk.config import EvalSettings
    from mlxlab.tasks.chunk.pref import ChunkPrefTask

    settings = EvalSettings(constrained=True)
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "eval_tuned.json").write_text(json.dumps({"ref": 90.0}))
    (sft / "eval_tuned.jsonl").write_text("{}\n")
    task = ChunkPrefTask(ChunkPrefConfig(eval=settings))
    task.sft = sft
    now = to_dict(settings)
    retired = {"cover": False, "read_overruled": False, "turns": None, "starts": None}
    cases = (
        ({**now, "read_overruled": False}, False),  # before eval.cover
        ({**now, "cover": False}, False),  # before eval.read_overruled
        ({**now, **retired, "cover": True}, False),
        ({**now, **retired, "split_bias": 0.5}, False),
        ({**now, **retired, "split_bias": 0.0}, True),
        (now, True),
    )
    for k, (saved, reused) in enumerate(cases):
        (sft / "config.yaml").write_text(yaml.safe_dump({"task": {"eval": saved}}))
        run = tmp_path / f"run-{k}"
        run.mkdir()
        assert task._reuse_sft_eval(run) is reused
        assert (run / "eval_sft.jsonl").is_file() is reused


@pytest.mark.slow  # end to end: an SFT task run, then GRPO on top of it (records, training, eval)
def test_grpo_run_on_top_of_a_chunk_sft_run(tiny_dir, tmp_path):
    from mlxlab.cli import compose
    from mlxlab.tasks.chunk.reward import check_records, chunk_reward
    from mlxlab.train import cli

    tiny_dir("gemma3")
    sft = _sft_run(tmp_path)
    report = tmp_path / "exp" / "README.md"
    summary = cli.run(
        compose(
            "train",
            [
                *COMMON,
                "task.name=chunk_pref",
                f"task.sft={sft}",
                "task.examples=3",
                "objective=grpo",
                "grpo.rewards=[mlxlab.tasks.chunk.reward:chunk_reward]",
                "grpo.group_size=2",
                "grpo.max_tokens=8",
                "batch_size=1",
                f"out_dir={tmp_path / 'grpo'}",
                f"task.report={report}",
            ],
        )
    )
    run = tmp_path / "grpo"
    made = json.loads((run / "data" / "prompts.json").read_text())
    assert made["examples"] == 3 and made["multi_chunk_examples"] == 2 and made["sft"] == str(sft)
    records = [json.loads(x) for x in (run / "data" / "train.jsonl").read_text().splitlines()]
    assert len(records) == 3 and check_records(records) is None
    assert all(r["messages"][0]["content"].startswith(pr.INSTRUCTIONS) for r in records)
    assert not (run / "data" / "pairs.json").exists()
    # SFT alone is the SFT run's own evaluation (same data, same settings), not a new one
    assert (run / "eval_sft.jsonl").read_bytes() == (sft / "eval_tuned.jsonl").read_bytes()
    assert set(summary["eval"]) == {"sft", "sft + grpo"}
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rolled = [r for r in steps if "reward_chunk_reward" in r]
    assert len(rolled) == 2
    completions = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 2
    # the rewards logged are chunk_reward's of the completions logged, against their prompt's
    # record (line: 1-based in train.jsonl); each step's mean is theirs
    for step, logged in zip(rolled, completions, strict=True):
        rows = logged["completions"]
        assert len(rows) == 2 and step["step"] == logged["step"]
        texts = [c["text"] for c in rows]
        again = chunk_reward(texts, [records[c["line"] - 1] for c in rows])
        assert [c["reward_chunk_reward"] for c in rows] == pytest.approx(again)
        assert [c["reward"] for c in rows] == pytest.approx(again)
        assert step["reward_chunk_reward"] == pytest.approx(sum(again) / len(again))
    text = report.read_text()
    assert "| sft | 3 |" in text and "| sft + grpo | 3 |" in text and str(sft) in text
    assert "GRPO (grpo, 2 completions a prompt" in text and "chunk_reward" in text
    assert "- prompts: 3 training examples (2 with two or more gold chunks)" in text
