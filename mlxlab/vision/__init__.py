"""Vision-language models on mlx-vlm: image decoding and checks (`images`), the prompt a VLM sees
(`prompt`), and the loaded model with its vision tower (`model`). Below `serve` and `generate`,
which both use it."""
