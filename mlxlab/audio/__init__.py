"""Speech: audio decoding (PyAV, codecs inside the wheel), Whisper base from PyPI's CTranslate2
packages converted to MLX and run with mlx-audio, transcript formats, word error rate."""
