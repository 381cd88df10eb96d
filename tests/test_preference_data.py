"""Preference data: the four record shapes, `file:line` errors, and response-only offsets."""

from __future__ import annotations

import json

import pytest

from mlxlab.data import preference
from mlxlab.errors import UserError

USER = {"role": "user", "content": "Name a prime."}
GOOD = {"role": "assistant", "content": "7"}
BAD = {"role": "assistant", "content": "8"}


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "Name a prime.", "chosen": "7", "rejected": "8"},
        {"messages": [USER], "chosen": "7", "rejected": [BAD]},
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
    ],
)
def test_every_shape_gives_the_same_pair(record):
    assert preference.split_record(record) == ([USER], [GOOD], [BAD])


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", "invalid JSON"),
        ('{"prompt": "p", "chosen": "a"}', "expected 'chosen' and 'rejected'"),
        ('{"prompt": "p", "chosen": 3, "rejected": "b"}', "'chosen' must be a string or"),
        ('{"chosen": "a", "rejected": "b"}', "no 'prompt' or 'messages'"),
        (
            '{"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", '
            '"content": "y"}]}',
            "must share their first messages",
        ),
        ('{"prompt": [{"content": "x"}], "chosen": "a", "rejected": "b"}', r"prompt\[0\] must be"),
        ('{"prompt": "", "chosen": "a", "rejected": "b"}', "'prompt' is empty"),
        (
            '{"prompt": [{"role": "user", "content": 5}], "chosen": "a", "rejected": "b"}',
            "must be a string or a list of parts",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps({"prompt": "ok", "chosen": "a", "rejected": "b"}) + "\n" + line + "\n"
    )
    with pytest.raises(UserError, match=message) as err:
        preference.read_pairs(path)
    assert f"{path}:2: " in str(err.value)


def test_empty_or_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no examples"):
        preference.read_pairs(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match="cannot read"):
        preference.read_pairs(tmp_path / "nope.jsonl")


def test_offsets_mark_the_response_tokens(tiny_dir):
    from mlx_lm.utils import load

    _, tokenizer = load(str(tiny_dir("gemma3")))
    pair = preference.tokenize_pair([USER], [GOOD], [BAD], tokenizer)
    head = tokenizer.apply_chat_template([USER], add_generation_prompt=True)
    for side, text in ((pair.chosen, "7"), (pair.rejected, "8")):
        assert side.ids[: side.offset] == head[: side.offset] and side.offset == len(head)
        assert tokenizer.decode(side.ids[side.offset :]).startswith(text)
    assert pair.chosen.ids[: pair.chosen.offset] == pair.rejected.ids[: pair.rejected.offset]


def test_long_pairs_are_cut_or_refused(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.config import DataConfig

    _, tokenizer = load(str(tiny_dir("gemma3")))
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps({"prompt": "Name a prime.", "chosen": "seven " * 200, "rejected": "8"}) + "\n"
        + json.dumps({"prompt": "word " * 400, "chosen": "7", "rejected": "8"}) + "\n"
    )  # fmt: skip
    cut = preference.load_pair_split(path, tokenizer, DataConfig(max_seq_length=64))
    # both pairs are cut; the second keeps no response token and is skipped
    assert cut.num_truncated == 2 and len(cut.examples) == 2
    assert all(len(e.ids) <= 64 for e in cut.examples)
    with pytest.raises(UserError, match="exceed max_seq_length=64"):
        preference.load_pair_split(
            path, tokenizer, DataConfig(max_seq_length=64, on_too_long="error")
        )


def test_sft_on_a_preference_file_points_at_the_objective(tmp_path):
    from mlxlab.data.datasets import read_records

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"messages": [USER], "chosen": "7", "rejected": "8"}) + "\n")
    with pytest.raises(UserError, match="objective=dpo or objective=orpo"):
        read_records(path)
