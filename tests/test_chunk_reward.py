"""The chunk task's GRPO reward and prompt records (mlxlab/tasks/chunk/reward.py) and the data
step that writes them from an SFT run's training windows (pref.py `build_prompts`)."""

from __future__ import annotations

import json
import random

import pytest

from mlxlab.errors import UserError
from mlxlab.tasks.chunk import pref
from mlxlab.tasks.chunk import prompt as pr
from mlxlab.tasks.chunk.config import ChunkDataConfig, ChunkPrefConfig
from mlxlab.tasks.chunk.reward import FLOOR, chunk_reward, prompt_record, reward_parts

U = [f"00000000-0000-4000-8000-00000000000{i}" for i in range(6)]
CASE = {
    "id": "case-1",
    "name": "two topics",
    "uuid": "11111111-2222-4333-8444-555555555555",
    "messages": [
        {"uuid": u, "sender": "user" if i % 2 == 0 else "assistant", "text": f"message {i}"}
        for i, u in enumerate(U)
    ],
}


def _gold(*spans):
    return [
        {"label": f"Topic number {k}", "start_message_uuid": U[s], "end_message_uuid": U[e]}
        for k, (s, e) in enumerate(spans)
    ]


def _record(gold):
    return prompt_record(CASE, CASE["messages"], gold)


def _reward(text, gold):
    return chunk_reward([text], [_record(gold)])[0]


def test_the_gold_answer_earns_full_reward_and_a_moved_boundary_less():
    gold = _gold((0, 1), (2, 3), (4, 5))
    assert _reward(pr.answer(gold), gold) == pytest.approx(1.0)
    assert _reward("```json\n" + pr.answer(gold) + "\n```", gold) == pytest.approx(1.0)
    moved = _gold((0, 2), (3, 3), (4, 5))  # one of two boundaries off by a message
    assert _reward(pr.answer(moved), gold) == pytest.approx(1 / 2 * (1 - FLOOR) + FLOOR)
    two = _gold((0, 1), (2, 5))
    assert _reward(pr.answer(pref.moved_boundary(two, U, random.Random(0))), two) == (
        pytest.approx(FLOOR)  # its only boundary wrong: valid, no boundary credit
    )
    assert _reward(pr.answer(_gold((0, 5))), two) == pytest.approx(FLOOR)  # one chunk
    generic = [{**c, "label": "discussion"} for c in two]
    assert FLOOR < _reward(pr.answer(generic), two) < 1.0  # ref takes its label points


def test_garbage_empty_and_made_up_uuids_earn_nothing():
    gold = _gold((0, 1), (2, 5))
    for text in ("", "no json here", '{"chunks": "x"}', "[1, 2]", pr.answer(gold)[:-8]):
        assert _reward(text, gold) == 0.0
    # valid JSON (ref 80) but no chunk: nothing, less than a valid answer with every boundary
    # wrong (FLOOR)
    ref, _, gated = reward_parts('{"chunks": []}', _record(gold))
    assert ref == pytest.approx(0.8) and not gated
    assert _reward('{"chunks": []}', gold) == 0.0
    assert _reward(pr.answer(_gold((0, 5))), gold) == pytest.approx(FLOOR)
    fake = [
        {**c, "start_message_uuid": f"f{k}" * 18, "end_message_uuid": f"e{k}" * 18}
        for k, c in enumerate(gold)
    ]
    ref, _, gated = reward_parts(pr.answer(fake), _record(gold))
    assert 0 < ref < 0.7 and not gated and _reward(pr.answer(fake), gold) == 0.0
    # one made-up uuid among real ones: the reference validator does not resolve it, nothing
    one_off = [{**gold[0], "end_message_uuid": "z" * 36}, gold[1]]
    assert _reward(pr.answer(one_off), gold) == 0.0
    # one chunk over made-up uuids: the strict scorer snaps it over the window (its boundary F1
    # would be 1 against a one-chunk gold), the reward gives nothing
    one = _gold((0, 5))
    fake_one = [{**one[0], "start_message_uuid": "x" * 36, "end_message_uuid": "y" * 36}]
    ref, f1, gated = reward_parts(pr.answer(fake_one), _record(one))
    assert f1 == 1.0 and not gated and _reward(pr.answer(fake_one), one) == 0.0
    assert _reward(pr.answer(one), one) == pytest.approx(1.0)


def test_check_refuses_records_the_reward_cannot_score():
    from mlxlab.train.grpo import rewards as R

    gold = _gold((0, 1), (2, 5))
    good = _record(gold)
    [fn] = R.resolve(["mlxlab.tasks.chunk.reward:chunk_reward"])
    R.check([fn], [good], "prompts")  # fine
    bad = [
        ({**good, "uuids": None}, "no 'uuids'"),
        ({**good, "uuids": [*good["uuids"], U[0]]}, "no 'uuids'"),  # not distinct
        ({k: v for k, v in good.items() if k != "conversation_uuid"}, "conversation_uuid"),
        ({k: v for k, v in good.items() if k != "chunks"}, "no gold 'chunks'"),
        ({**good, "chunks": []}, "no gold 'chunks'"),
        ({**good, "chunks": [{**gold[0], "end_message_uuid": "elsewhere"}]}, "no gold 'chunks'"),
        ({**good, "chunks": [{**gold[0], "label": None}]}, "no gold 'chunks'"),
    ]
    for record, message in bad:
        with pytest.raises(UserError, match=message) as e:
            R.check([fn], [good, record], "prompts")
        assert "record 2" in str(e.value) and "\n" not in str(e.value)


def test_prompt_records_are_the_sft_examples_prompts(tiny_dir, tmp_path):
    """The data step's records render (prompts.py, as GRPO reads them) to exactly the prompt
    part of the SFT run's training examples, and carry the gold the reward scores 1.0."""
    from mlx_lm.utils import load_tokenizer

    from mlxlab.data.datasets import tokenize
    from mlxlab.data.prompts import render, split_record
    from mlxlab.tasks.chunk import dataset
    from mlxlab.tasks.chunk.reward import check_records

    data = dataset.write_dataset(
        tmp_path / "sft" / "data",
        ChunkDataConfig(train=4, valid=1, test=1, train_topic_weights=[0, 1]),
    )
    tokenizer = load_tokenizer(tiny_dir("gemma3"))
    records, stats = pref.build_prompts(data, ChunkPrefConfig(examples=5, multi_share=0.6))
    assert stats["examples"] == len(records) == 5 and stats["multi_chunk_examples"] == 3
    assert sum(len(r["chunks"]) >= 2 for r in records) == 3
    assert stats["windows"] == len((data / "train.jsonl").read_text().splitlines())
    examples = {}
    for line in (data / "train.jsonl").read_text().splitlines():
        ex = json.loads(line)
        examples[ex["messages"][0]["content"]] = ex
    for r in records:
        ex = examples[r["messages"][0]["content"]]  # the SFT example with this very prompt
        assert ex["messages"][1]["content"] == pr.answer(r["chunks"])
        sft = tokenize(ex, tokenizer, mask_prompt=True)
        assert render(split_record(r), tokenizer) == sft.ids[: sft.offset]
    assert check_records(records) is None
    golds = [pr.answer(r["chunks"]) for r in records]
    assert chunk_reward(golds, records) == pytest.approx([1.0] * 5)
    # the same windows as the preference pairs pick (same seed)
    windows = pref.sft_windows(data)
    picked = pref.pick(windows, 5, 0.6, random.Random(0))
    assert [r["messages"][0]["content"] for r in records] == [pr.prompt(c, m) for c, m, _ in picked]
    # a directory of these records gives evaluation its window budget as chat examples do
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dataset.training_window(tmp_path / "p", tokenizer) == max(
        len(render(split_record(r), tokenizer)) for r in records
    )
