"""Sentence embeddings: a BERT-family model (mlx-embeddings' classes) with the model's own
pooling and normalization, batched."""
