"""/v1/embeddings on tiny-bert (a random-init BERT from mlx-embeddings' class) in-process: our
vectors against a plain numpy BERT, batching that does not change a vector, base64 that decodes
to the same floats, token-array inputs, `dimensions` (tiny-bert is marked Matryoshka; the real
model is not: test_embeddings_real), over-length inputs (400, or truncated when asked), the
missing-model 400, /v1/models."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.helpers.bert_numpy import sentence_vector
from tests.helpers.serve import make_client

TEXTS = [
    "The os module provides a portable way of using operating system dependent functionality.",
    "json",
    "Return a new list containing all items from the iterable in ascending order.",
    "Hello, world!",
]


@pytest.fixture(scope="module")
def served(tiny_dir, session_home):
    tiny_dir("gemma3")
    client, gateway = make_client(embeddings_model="tiny-bert", max_tokens=4)
    yield client, gateway.loaded.embedder
    gateway.stop()


def vectors(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], np.float64)


def test_vectors_equal_a_plain_numpy_bert(served):
    client, embedder = served
    got = vectors(client.post("/v1/embeddings", json={"input": TEXTS, "model": "any"}))
    assert got.shape == (len(TEXTS), 32)
    for i, ids in enumerate(embedder.tokenize(TEXTS)):
        want = sentence_vector(embedder.path, ids)
        np.testing.assert_allclose(got[i], want, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_a_vector_does_not_depend_on_its_batch(served):
    client, _ = served
    many = [f"{TEXTS[i % 4]} {'again ' * (i % 7)}" for i in range(140)]  # > 128: two batches
    together = vectors(client.post("/v1/embeddings", json={"input": many}))
    alone = np.stack(
        [vectors(client.post("/v1/embeddings", json={"input": t}))[0] for t in many[:6]]
    )
    np.testing.assert_allclose(together[:6], alone, atol=1e-6)


def test_base64_decodes_to_the_same_floats(served):
    client, _ = served
    floats = client.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
    b64 = client.post("/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"})
    for f, b in zip(floats["data"], b64.json()["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.array(f["embedding"], np.float32))
    assert b64.json()["usage"] == floats["usage"]


def test_token_arrays_and_usage(served):
    client, embedder = served
    ids = embedder.tokenize(TEXTS[:2])
    by_text = client.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
    by_ids = client.post("/v1/embeddings", json={"input": ids}).json()
    one = client.post("/v1/embeddings", json={"input": ids[0]}).json()
    assert by_text["data"] == by_ids["data"]
    np.testing.assert_allclose(  # alone vs padded in a batch: equal to float rounding
        one["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-6
    )
    n = sum(map(len, ids))
    assert by_text["usage"] == {"prompt_tokens": n, "total_tokens": n}
    r = client.post("/v1/embeddings", json={"input": [[1, 2, 10**6]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"


def test_dimensions_shorten_and_renormalize_where_the_model_allows(served):
    client, _ = served
    full = vectors(client.post("/v1/embeddings", json={"input": TEXTS[0]}))[0]
    short = vectors(client.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 8}))[0]
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 33})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 0}).status_code == 400


def test_over_length_input_is_a_400_unless_truncation_is_asked(served):
    client, embedder = served
    long = "the standard library " * 40  # over tiny-bert's 64 tokens
    r = client.post("/v1/embeddings", json={"input": ["ok", long]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input[1]" and err["code"] == "input_too_long"
    cut = client.post("/v1/embeddings", json={"input": long, "truncate": True})
    ids = embedder.truncating.encode(long).ids
    assert len(ids) == 64 and cut.json()["usage"]["prompt_tokens"] == 64
    np.testing.assert_allclose(
        vectors(cut)[0], sentence_vector(embedder.path, ids), atol=2e-6, rtol=0
    )
    # truncating asked for, a short input is read as it is: no padding counted as its text
    short = vectors(client.post("/v1/embeddings", json={"input": "ok", "truncate": True}))
    np.testing.assert_allclose(
        short[0], vectors(client.post("/v1/embeddings", json={"input": "ok"}))[0], atol=1e-6
    )
    assert embedder.tokenize(["ok"], truncate=True) == embedder.tokenize(["ok"])
    # one token array longer than the input cap counts as one input (its length is tokens)
    many = client.post("/v1/embeddings", json={"input": [7] * 3000})
    assert many.status_code == 400 and many.json()["error"]["code"] == "input_too_long"
    assert (
        client.post("/v1/embeddings", json={"input": [7] * 3000, "truncate": True}).json()["usage"][
            "prompt_tokens"
        ]
        == 64
    )


@pytest.mark.parametrize(
    "body", [{"input": ""}, {"input": []}, {"input": ["a", ""]}, {"input": [[]]}, {"input": 3}, {}]
)
def test_bad_inputs_are_400s(served, body):
    client, _ = served
    assert client.post("/v1/embeddings", json=body).status_code == 400


def test_models_lists_the_embedding_model(served):
    client, _ = served
    card = client.get("/v1/models/tiny-bert").json()
    assert card["type"] == "embeddings" and card["dimensions"] == 32


def test_without_an_embedding_model_the_400_says_how_to_serve_one(tiny_dir):
    tiny_dir("gemma3")
    client, gateway = make_client(max_tokens=4)
    try:
        r = client.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400
        assert "embeddings_model=all-minilm-l6-v2" in r.json()["error"]["message"]
    finally:
        gateway.stop()


def test_batches_keep_to_their_row_and_token_caps():
    from mlxlab.embed.model import BATCH, BATCH_TOKENS, batches

    ids = [[1] * n for n in [3, 250, 7, 256, 5] * 60]
    groups = batches(ids)
    assert sorted(i for g in groups for i in g) == list(range(len(ids)))
    for g in groups:
        assert len(g) <= BATCH and len(g) * max(len(ids[i]) for i in g) <= BATCH_TOKENS
    assert max(len(g) for g in groups) == BATCH  # short inputs fill whole batches
