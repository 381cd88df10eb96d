"""Data: the three JSONL formats, prompt masking as mlx-lm does it, errors with file:line."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mlxlab  # noqa: F401
from mlxlab.config import DataConfig, UserError
from mlxlab.data import batches as B
from mlxlab.data import datasets as D

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."},
    ]
}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _line_errors(path, expected: list[tuple[int, str]]) -> str:
    """read_records' error for `path`, checked to name each (line, text) of `expected`."""
    with pytest.raises(UserError) as err:
        D.read_records(path)
    msg = str(err.value)
    for line, text in expected:
        assert text in next(x for x in msg.splitlines() if f"{path.name}:{line}:" in x)
    return msg


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_dir("gemma3"))


def test_chat_and_completions_match_mlx_lm(tokenizer):
    from mlx_lm.tuner.datasets import ChatDataset, CompletionsDataset

    ours = D.tokenize(CHAT, tokenizer, mask_prompt=True)
    theirs = ChatDataset([CHAT], tokenizer, mask_prompt=True).process(CHAT)
    assert (ours.ids, ours.offset) == (list(theirs[0]), theirs[1])
    comp = {"prompt": "What is 2+2?", "completion": "Four."}
    ours = D.tokenize(comp, tokenizer, mask_prompt=True)
    theirs = CompletionsDataset([comp], tokenizer, "prompt", "completion", True).process(comp)
    assert (ours.ids, ours.offset) == (list(theirs[0]), theirs[1])
    assert tokenizer.decode(ours.ids[ours.offset :]) == "Four.<end_of_turn>\n"
    assert D.tokenize(comp, tokenizer, mask_prompt=False).offset == 0


def test_text_gets_eos(tokenizer):
    ex = D.tokenize({"text": "Hello there"}, tokenizer, mask_prompt=True)
    assert ex.ids[-1] == tokenizer.eos_token_id and ex.offset == 0


def test_bad_lines_are_reported_with_file_and_line(tmp_path):
    path = _write(
        tmp_path / "train.jsonl",
        [
            CHAT,
            "{not json",
            {"foo": 1},
            {"messages": []},
            {"messages": [{"content": "x"}]},
            {"prompt": 3, "completion": "x"},
        ],
    )
    msg = _line_errors(
        path,
        [
            (2, "invalid JSON"),
            (3, "expected an object"),
            (4, "non-empty list"),
            (5, "messages[0] must be an object with a 'role'"),
            (6, "must be strings"),
        ],
    )
    assert "mixes formats" in msg


def test_records_a_probe_crashed_on_are_named_or_train(tmp_path, tokenizer):
    """A CLI probe's tracebacks: content of the wrong type (in the tokenizer), a line that is
    not UTF-8, a one-message chat (the chat template refused the empty prompt). What mlx-lm's
    own trainer takes stays accepted: other roles, a chat not ending with the assistant."""
    user = {"role": "user", "content": "hi"}
    path = _write(
        tmp_path / "train.jsonl",
        [{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}],
    )
    _line_errors(path, [(1, "messages[0].content must be a string or a list of content parts")])
    one = D.tokenize({"messages": [user]}, tokenizer, mask_prompt=True)
    assert one.offset == 0 and one.ids
    ok = _write(
        tmp_path / "ok.jsonl",
        [
            {"messages": [{"role": "model", "content": "x"}, user]},
            {"messages": [user, {"role": "assistant", "content": ""}]},
        ],
    )
    assert len(D.read_records(ok)) == 2
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"text": "ok"}\n\xff\xfe garbage\n')
    with pytest.raises(UserError, match=r"b.jsonl:2: not UTF-8 text"):
        D.read_records(binary)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\r\n')
    assert D.read_records(bom) == [{"text": "ok"}]


def test_a_directory_without_train_jsonl_says_so(tmp_path):
    from mlxlab.config import DataConfig as Data

    (tmp_path / "valid.jsonl").write_text("")
    with pytest.raises(UserError, match="no train.jsonl in that directory .it has valid.jsonl"):
        D.resolve_paths(Data(train=str(tmp_path)))
    (tmp_path / "train.jsonl").mkdir()
    with pytest.raises(UserError, match="train.jsonl is not a file"):
        D.resolve_paths(Data(train=str(tmp_path)))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(UserError, match="no such data file"):
        D.read_records(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="no examples"):
        D.read_records(_write(tmp_path / "empty.jsonl", []))


def test_datasets_directory_is_accepted(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"text": "one"}, {"text": "two"}]).save_to_disk(
        str(tmp_path / "ds")
    )
    assert [r["text"] for r in D.read_records(tmp_path / "ds")] == ["one", "two"]


def test_truncation_is_counted_or_rejected(tmp_path, tokenizer, caplog):
    long = {"prompt": "x", "completion": "word " * 200}
    path = _write(tmp_path / "t.jsonl", [long, long, {"prompt": "q", "completion": "a"}])
    split = D.load_split(path, tokenizer, DataConfig(max_seq_length=64))
    assert split.num_truncated == 2 and all(len(e.ids) <= 64 for e in split.examples)
    assert "2 of 3 examples" in caplog.text
    with pytest.raises(UserError, match="2 examples exceed max_seq_length=64"):
        D.load_split(path, tokenizer, DataConfig(max_seq_length=64, on_too_long="error"))


def test_resolve_paths(tmp_path):
    _write(tmp_path / "train.jsonl", [CHAT])
    _write(tmp_path / "valid.jsonl", [CHAT])
    assert D.resolve_paths(DataConfig(train=str(tmp_path))) == (
        tmp_path / "train.jsonl",
        tmp_path / "valid.jsonl",
    )
    with pytest.raises(UserError, match="data.train is not set"):
        D.resolve_paths(DataConfig())


def test_collate_positions_cover_exactly_the_response():
    a = D.Example(ids=[2, 10, 11, 12, 13], offset=3)  # trains tokens 12, 13
    b = D.Example(ids=[2, 20, 21], offset=0)  # trains 20, 21 (never the first token)
    batch = B.collate([a, b])
    assert batch.ntoks == 4 and batch.inputs.shape == (2, 32)
    targets, mask = B.dense_targets(batch)
    t, m = np.array(targets), np.array(mask)
    assert list(t[0][m[0] == 1]) == [12, 13] and list(t[1][m[1] == 1]) == [20, 21]
    assert float(np.array(batch.weights).sum()) == 4 and batch.positions.shape == (32,)


def test_sampler_resumes_mid_epoch():
    exs = [D.Example(ids=list(range(2, 5 + i % 7)), offset=0) for i in range(20)]
    s = B.BatchSampler(exs, 3, seed=1)
    seq = [np.array(s.next().inputs) for _ in range(10)]  # crosses an epoch (6 batches each)
    s2 = B.BatchSampler(exs, 3, seed=1)
    for _ in range(4):
        s2.next()
    s3 = B.BatchSampler(exs, 3, seed=1)
    s3.restore(s2.state())
    assert all(np.array_equal(seq[i], np.array(s3.next().inputs)) for i in range(4, 10))
    with pytest.raises(UserError, match="fewer than batch_size"):
        B.BatchSampler(exs[:2], 3, seed=0)


def test_loss_weights_weigh_the_tokens_of_their_spans(tmp_path, tokenizer):
    record = {
        **CHAT,
        "messages": [*CHAT["messages"][:-1], {"role": "assistant", "content": "Four, I think."}],
    }
    plain = D.tokenize(record, tokenizer, mask_prompt=True)
    assert plain.weights is None
    weighted = D.tokenize({**record, "loss_weights": [[0, 4, 3.0]]}, tokenizer, mask_prompt=True)
    assert weighted.ids == plain.ids and weighted.offset == plain.offset
    pairs = zip(weighted.ids, weighted.weights, strict=True)
    heavy = [tokenizer.decode([t]) for t, w in pairs if w == 3.0]
    assert "".join(heavy).strip() == "Four"  # the span's tokens, and only them
    assert all(w == 1.0 for w in weighted.weights[: weighted.offset])
    # the batch carries each target's own weight (target t+1 at position t); the mean loss is
    # over their sum; packed rows keep each example's weights in place, in either order
    batch = B.collate([weighted, plain])
    n = batch.ntoks
    w = np.array(batch.weights)[:n]
    np.testing.assert_array_equal(w[: n // 2], weighted.weights[weighted.offset :])
    assert n == 2 * (len(plain.ids) - plain.offset) and w[0] == 3.0 and set(w[n // 2 :]) == {1.0}
    assert batch.units == float(w.sum()) > n and B.collate([plain]).weight is None
    for row in ([weighted, plain], [plain, weighted]):
        packed = B.collate_rows([row])
        np.testing.assert_array_equal(
            np.array(packed.weights)[:n],
            np.concatenate(
                [
                    np.ones(len(e.ids) - e.offset) if e.weights is None else e.weights[e.offset :]
                    for e in row
                ]
            ),
        )
    _, mask = B.dense_targets(batch)
    assert float(np.array(mask).sum()) == batch.units  # the full-logits loss weighs the same
    # without prompt masking the prompt trains at weight 1 and the span keeps its weight
    unmasked = D.tokenize({**record, "loss_weights": [[0, 4, 3.0]]}, tokenizer, mask_prompt=False)
    assert unmasked.offset == 0 and unmasked.weights == weighted.weights
    # a template that trims the content: the spans shift with the leading whitespace it drops
    padded = {
        **record,
        "messages": [
            *CHAT["messages"][:-1],
            {"role": "assistant", "content": "  Four, I think.\n"},
        ],
        "loss_weights": [[2, 6, 3.0]],
    }
    assert D.tokenize(padded, tokenizer, mask_prompt=True).weights == weighted.weights
    # truncation cuts the weights with the ids; an example whose every target weighs 0 is dropped
    zero = {**record, "loss_weights": [[0, 14, 0.0]]}
    path = _write(tmp_path / "t.jsonl", [{**record, "loss_weights": [[0, 4, 3.0]]}, zero])
    split = D.load_split(path, tokenizer, DataConfig(max_seq_length=len(plain.ids) - 2))
    (cut,) = split.examples
    assert cut.weights == weighted.weights[: len(plain.ids) - 2] and len(cut.weights) == len(
        cut.ids
    )
    # the file check names bad spans with their line
    bad = [
        {**record, "loss_weights": [[0, 99, 2.0]]},
        {**record, "loss_weights": [[0, 2]]},
        {**record, "loss_weights": [[0, 2, -1]]},
        {"text": "hi", "loss_weights": [[0, 1, 2.0]]},
        {"messages": CHAT["messages"][:-1], "loss_weights": [[0, 1, 2.0]]},
        {**record, "loss_weights": [[0, 2, 1e39]]},
        {**record, "loss_weights": "0-2"},
    ]
    _line_errors(
        _write(tmp_path / "w.jsonl", [record, *bad]),
        [
            (2, "not within the 14-char response"),
            (3, "[start, end, weight]"),
            (4, "must be in [0, 1e+06]"),
            (5, "needs a response"),
            (6, "assistant's response"),
            (7, "must be in [0, 1e+06]"),
            (8, "must be a list"),
        ],
    )
    # a saved datasets directory is checked the same way (its numbers come back as floats)
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{**record, "loss_weights": [[0, 99, 2.0]]}]).save_to_disk(saved)
    with pytest.raises(UserError, match="row 0: loss_weights"):
        D.read_records(saved)
    good = tmp_path / "good"
    datasets.Dataset.from_list([{**record, "loss_weights": [[0, 4, 3]]}]).save_to_disk(good)
    (row,) = D.read_records(good)
    assert D.tokenize(row, tokenizer, mask_prompt=True).weights == weighted.weights
    # a response whose tokens do not spell it out (a blank one, which the template trims away)
    # names the example
    mangled = {**record, "loss_weights": [[0, 2, 3.0]]}
    mangled["messages"] = [*CHAT["messages"][:-1], {"role": "assistant", "content": "   "}]
    with pytest.raises(UserError, match=r"example 1: loss_weights"):
        D.load_split(_write(tmp_path / "m.jsonl", [mangled]), tokenizer, DataConfig())
