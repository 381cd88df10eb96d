"""Tokenizers built locally: from a GGUF's metadata, and a small trained one for tiny test models
(neither touches the network; both become Hugging Face "fast" tokenizer files that mlx-lm loads);
and the tokenizers of loaded models shared between copies of a model (`shared_tokenizer`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
import weakref
from pathlib import Path

from mlxlab.fsutil import sha256_file

# Gemma's turn format (the GGUF of a base model ships no template). A system message is folded
# into the first user turn, as Gemma's own template does. Gemma 3 has no tool tokens; tools are
# offered in the first turn and called as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
# (the Hermes/Qwen JSON form, which mlx-lm's `json_tools` parser reads); tool results come back
# as user turns wrapped in <tool_response>. Without tools the template renders exactly as before.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns = namespace(text='You can call these tools. To call one, reply with '"
    ' + \'<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>.\n\') -%}'
    "{%- for tool in tools -%}{%- set ns.text = ns.text + (tool.function if tool.function is defined"
    " else tool) | tojson + '\n' -%}{%- endfor -%}"
    "{%- set first_prefix = first_prefix + ns.text + '\n' -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else ('user' if message['role'] == 'tool'"
    " else message['role']) -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set text = '' -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}{%- set text = '<tool_response>' + text + '</tool_response>' -%}{%- endif -%}"
    "{%- if message.tool_calls is defined and message.tool_calls -%}"
    "{%- set calls = namespace(text=text) -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set tool_call = call.function if call.function is defined else call -%}"
    '{%- set calls.text = calls.text + \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \''
    " + (tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson)"
    " + '}</tool_call>' -%}"
    "{%- endfor -%}{%- set text = calls.text -%}{%- endif -%}"
    "{{- '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') + text | trim"
    " + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.add_space_prefix": "add_prefix_space",
}


def read_field(reader, key, default=None):
    """A GGUF metadata value; arrays read in bulk (field.contents() is slow on 262k entries)."""
    import gguf
    import numpy as np

    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        items = [f.parts[i] for i in f.data]
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in items]
        return np.concatenate(items).tolist() if items else []
    return f.contents()


def _add_bos_processor(backend, bos: str, bos_id: int) -> None:
    from tokenizers import processors

    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
    )


def from_gguf(reader, arch: str):
    """(PreTrainedTokenizerFast, info) for the tokenizer a GGUF describes.

    info["config"] holds the special-token ids for config.json, info["generation_config"] the
    generation_config.json contents.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from mlxlab.errors import UserError

    data = {name: read_field(reader, f"tokenizer.{key}") for key, name in _TOKENIZER_KEYS.items()}
    data = {k: v for k, v in data.items() if v is not None}
    if "tokens" not in data:
        raise UserError("GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, data)
    except ValueError as e:
        raise UserError(f"cannot build the tokenizer: {e}") from e
    tokens = data["tokens"]

    def special(key):
        idx = read_field(reader, f"tokenizer.ggml.{key}")
        return (int(idx), tokens[int(idx)]) if idx is not None and int(idx) < len(tokens) else None

    bos, eos, pad, unk = (
        special(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id")
    )
    add_bos = read_field(reader, "tokenizer.ggml.add_bos_token")
    if bos and (add_bos or add_bos is None and data.get("tokenizer_type") == "llama"):
        _add_bos_processor(backend, bos[1], bos[0])
    template = read_field(reader, "tokenizer.chat_template")
    eos_ids = [eos[0]] if eos else []
    if arch == "gemma3":
        template = template or GEMMA_CHAT_TEMPLATE
        end_of_turn = backend.token_to_id("<end_of_turn>")
        if end_of_turn is not None:
            eos_ids.append(end_of_turn)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos and bos[1],
        eos_token=eos and eos[1],
        pad_token=pad and pad[1],
        unk_token=unk and unk[1],
    )
    if template:
        tokenizer.chat_template = template
    ids = {
        "bos_token_id": bos and bos[0],
        "eos_token_id": eos_ids or None,
        "pad_token_id": pad and pad[0],
    }
    ids = {k: v for k, v in ids.items() if v is not None}
    return tokenizer, {"config": ids, "generation_config": dict(ids), "vocab_size": len(tokens)}


# --- a small real tokenizer for tiny test models ------------------------------------------------

TINY_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def _tiny_corpus() -> list[str]:
    """Fixed English and code text: module docstrings of Python's stdlib, shipped with mlxlab."""
    text = (Path(__file__).parent / "tiny_corpus.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


def build_tiny(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on stdlib text, with Gemma-style chat specials.

    Deterministic (trained on a corpus file in the package); ids 0-5 are the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_tiny_corpus(), trainer=trainer)
    _add_bos_processor(backend, "<bos>", backend.token_to_id("<bos>"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


# --- one tokenizer for copies of a model ------------------------------------------------------

TOKENIZER_PATTERNS = (
    "*.json",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
"""The files mlx-lm's `load_tokenizer` fetches for a tokenizer (its `allow_patterns`, in
mlx_lm/utils.py): all it (and transformers' AutoTokenizer under it) reads of a model directory."""

_TOKENIZERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Tokenizers of loaded models by `tokenizer_key` and end tokens, while a model holds one."""
_FILE_SHA: dict[tuple, str] = {}  # (real path, size, mtime_ns) -> sha256 of the content
_TOKENIZERS_LOCK = threading.Lock()


def tokenizer_files(path: Path) -> list[Path]:
    """The files of a model directory a tokenizer is read from (TOKENIZER_PATTERNS), by name."""
    return [
        f
        for f in sorted(Path(path).iterdir())
        if any(fnmatch.fnmatch(f.name, p) for p in TOKENIZER_PATTERNS) and f.is_file()
    ]


def tokenizer_key(path: Path) -> str:
    """The identity of what mlx-lm's `load_tokenizer` reads from a model directory: a hash of
    its tokenizer files (`tokenizer_files`: tokenizer, chat template, configs), by content, so
    copies of a model (a fine-tune's directory, the same files linked elsewhere) share it; other
    files (weights, a README, images) are not read."""
    out = hashlib.sha256()
    for f in tokenizer_files(path):
        real = f.resolve()
        st = real.stat()
        sig = (str(real), st.st_size, st.st_mtime_ns)
        digest = _FILE_SHA.get(sig)
        if digest is None:
            digest = _FILE_SHA[sig] = sha256_file(real)
        out.update(f"{f.name}\0{digest}\0".encode())
    return out.hexdigest()


def shared_tokenizer(path: Path, eos_token_ids=None):
    """mlx-lm's `load_tokenizer(path, eos_token_ids=...)`, or the one a model loaded from the
    same tokenizer files has (`tokenizer_key`; kept while a model holds it). A tokenizer of a
    large vocabulary takes seconds to build, holding Python's GIL (Gemma 3's 262k: ~3-5 s), and
    its grammar vocabulary (keyed by the tokenizer: grammar.vocab_for) as long again: a model
    served beside a copy of itself pays for neither, nor do the models generating meanwhile."""
    from mlx_lm.utils import load_tokenizer

    key = (tokenizer_key(path), repr(eos_token_ids))
    with _TOKENIZERS_LOCK:
        tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = load_tokenizer(Path(path), eos_token_ids=eos_token_ids)
        with _TOKENIZERS_LOCK:
            tokenizer = _TOKENIZERS.setdefault(key, tokenizer)
    return tokenizer
