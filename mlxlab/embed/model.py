"""`Embedder`: texts or token ids -> sentence vectors, the way the model's sentence-transformers
files say (pooling over the last hidden states, then L2 normalization if it has a Normalize
module), computed with mlx-embeddings' BERT in float32.

Tokenizing (`tokenize`) is plain Python/Rust and may run on any thread; `embed` is MLX work:
call it only from the thread that owns MLX (the server's engine thread). Inputs are sorted by
length and run in batches (`batches`: at most BATCH rows and BATCH_TOKENS tokens) padded to their longest (the padding is
masked out of attention and pooling, so a vector is the same in any batch, to float rounding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlxlab.errors import UserError

BATCH = 128
"""Rows per batch at most. Measured (all-MiniLM-L6-v2, 256 inputs of 16 tokens, 2-core box):
8 rows 34/s, 32 rows 55/s, 128 rows 85/s, 256 rows 85/s."""
BATCH_TOKENS = 8192
"""Padded tokens per batch at most (rows x the longest): bounds the attention scores' memory."""


class TooLong(UserError):
    """An input longer than the model takes (and truncation was not asked for)."""

    def __init__(self, index: int, n: int, limit: int):
        super().__init__(
            f"input[{index}] is {n} tokens, over this model's {limit}: shorten it or ask for "
            'truncation ("truncate": true)'
        )
        self.index = index


class Embedder:
    """A loaded embedding model: `Embedder("all-minilm-l6-v2")` (a zoo name or an MLX
    embedding directory)."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer

        from mlxlab.models import sentence, zoo

        if spec in zoo.ZOO and zoo.ZOO[spec].kind != "embeddings":
            raise UserError(
                f"{spec} is not an embedding model (embedding models: "
                f"{', '.join(n for n, e in zoo.ZOO.items() if e.kind == 'embeddings')})"
            )
        self.name = spec if spec in zoo.ZOO else Path(spec).name
        self.path = zoo.resolve(spec)
        self.model, self.tokenizer, self.settings = sentence.load(self.path)
        self.dimensions = int(self.settings["dimensions"])
        self.max_tokens = int(self.settings["max_seq_length"])
        self.matryoshka = bool(self.settings.get("matryoshka"))
        self.vocab_size = self.tokenizer.get_vocab_size()
        # A second tokenizer that truncates (keeping [CLS] ... [SEP]): one object each, never
        # reconfigured, so tokenizing from several threads is safe. Without padding, as the first
        # (sentence.load): tokenizer.json pads every text to 128, and those [PAD]s would be read
        # as text.
        self.truncating = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.truncating.no_padding()
        self.truncating.enable_truncation(self.max_tokens)

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids with the model's special tokens; TooLong names the first input over
        `max_tokens` unless `truncate`."""
        tok = self.truncating if truncate else self.tokenizer
        ids = [e.ids for e in tok.encode_batch(list(texts))]
        if not truncate:
            check_lengths(ids, self.max_tokens)
        return ids

    def embed(self, ids: list[list[int]]) -> np.ndarray:
        """[n, dimensions] float32 sentence vectors for token-id sequences (MLX: the owning
        thread only). Empty sequences are the caller's to refuse."""
        out = np.zeros((len(ids), self.dimensions), np.float32)
        for rows in batches(ids):
            out[rows] = self._batch([ids[i] for i in rows])
        return out

    def _batch(self, seqs: list[list[int]]) -> np.ndarray:
        import mlx.core as mx

        width = max(len(s) for s in seqs)
        tokens = np.zeros((len(seqs), width), np.int32)
        mask = np.zeros((len(seqs), width), np.float32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
            mask[r, : len(s)] = 1.0
        m = mx.array(mask)
        hidden = self.model(
            mx.array(tokens), token_type_ids=mx.zeros_like(mx.array(tokens)), attention_mask=m
        ).last_hidden_state
        vectors = pool(hidden, m, self.settings["pooling"])
        if self.settings.get("normalize"):
            vectors = normalize(vectors)
        mx.eval(vectors)
        return np.array(vectors, dtype=np.float32)


def batches(ids: list[list[int]]) -> list[list[int]]:
    """Input indices grouped for batching: sorted by length (little padding), at most BATCH rows
    and BATCH_TOKENS padded tokens each."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < BATCH and (len(out[-1]) + 1) * len(ids[i]) <= BATCH_TOKENS:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def check_lengths(ids: list[list[int]], limit: int) -> None:
    for i, s in enumerate(ids):
        if len(s) > limit:
            raise TooLong(i, len(s), limit)


def pool(hidden, mask, how: str):
    """sentence-transformers' Pooling over [B, L, D] states with a [B, L] 0/1 mask."""
    import mlx.core as mx

    m = mask[..., None]
    if how == "cls":
        return hidden[:, 0]
    if how == "max":
        return mx.where(m > 0, hidden, mx.array(-1e9, hidden.dtype)).max(axis=1)
    summed = (hidden * m).sum(axis=1)
    count = mx.maximum(m.sum(axis=1), 1e-9)
    if how == "mean":
        return summed / count
    if how == "mean_sqrt_len_tokens":
        return summed / mx.sqrt(count)
    raise UserError(f"unknown pooling {how!r}")


def normalize(x):
    """L2 normalization as torch's F.normalize (eps 1e-12)."""
    import mlx.core as mx

    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def shorten(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka: the first `dimensions` components, L2-normalized again."""
    cut = np.ascontiguousarray(vectors[:, :dimensions], dtype=np.float32)
    norms = np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return (cut / norms).astype(np.float32)
