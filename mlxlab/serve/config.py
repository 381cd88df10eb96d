"""The server's settings (`python -m mlxlab serve`, `python -m mlxlab runs`): dataclasses with a
docstring per field and checks in `__post_init__`, as every command's config (mlxlab/config.py).
The engine and the decoder take small settings types of their own, built from these
(`ServeConfig.engine()`, `ServeConfig.decode()`), so nothing below the server reads them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlxlab import registry
from mlxlab.config import DECODE_HEADS, DEFAULT_MODEL, DTYPES
from mlxlab.decode.settings import DecodeSettings
from mlxlab.decode.speculative import check_mode
from mlxlab.errors import UserError
from mlxlab.schema import check_choice
from mlxlab.serve.engine.settings import EngineSettings


def is_kv_quant(setting) -> bool:
    """The format of `serve.kv_quant` (whether it fits the model is checked when it loads)."""
    text = str(setting).strip()
    return text.lower() in ("off", "none", "0", "false", "4", "8", "config") or text.endswith(
        ".json"
    )


@dataclass
class ServeConfig:
    """`python -m mlxlab serve`: OpenAI-compatible HTTP API over one model."""

    model: str = DEFAULT_MODEL
    """The default model: zoo name, mlx-lm model directory, .gguf file or Hugging Face repo id;
    it answers requests that name it or no model."""
    models: dict[str, str] = field(default_factory=dict)
    """Further models a request's `model` may name, name -> spec (as `model`):
    `models.small=tiny-llama models.qwen=Qwen/Qwen3-0.6B`. Loaded when first asked for, kept
    under memory_budget_gb (the least recently used idle one is unloaded to make room). With
    any set, a request naming an unknown model gets 404 model_not_found."""
    model_adapters: dict[str, dict[str, str]] = field(default_factory=dict)
    """Adapters mounted on a model of `models` each time it loads, name -> (id -> adapter
    directory or training run directory): `model_adapters.small.chat=outputs/<run>` (the
    default model's are `adapters.`)."""
    models_from_cache: bool = False
    """Every model in the local Hugging Face cache may also be named, by its repo id."""
    model_idle_s: float = 0.0
    """Unload a model other than the default after this many seconds without a request; 0: never."""
    load_share: float = 1.0
    """While other models generate, the share of the time a model's load may take (0 < x <= 1;
    its weights are evaluated in slices between decode steps; below 1, it waits after each,
    engine/pacer.py)."""
    dtype: str = "auto"
    """Compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16."""
    decode_head: str = "auto"
    """What decode steps read on the CPU: auto (bf16 copies of the LM head and every other
    linear, read with float32 sums, where that is lossless, as for zoo models: half the bytes of
    a step, for half the weights' size in memory), exact (the float32 weights), or bfloat16 (the
    head's copy even where it rounds: opt-in, approximate; `diag decode decode_head=bfloat16`
    measures it)."""
    host: str = "127.0.0.1"
    """Interface to bind (loopback by default; 0.0.0.0 exposes the server to the network)."""
    port: int = 8090
    """TCP port; the server refuses to start if it is taken."""
    max_queue: int = 16
    """Requests waiting for the model beyond which new ones get 503 + Retry-After."""
    max_body_mb: float = 16.0
    """Largest request body, in MB (10^6 bytes); a larger one gets 413 before any router runs."""
    read_timeout_s: float = 30.0
    """A client has this long to send its request headers, and then this long for its body (a
    route with its own larger cap, as audio uploads, adds a second per MB of that cap); a
    stalled or trickling client is dropped (408 once its headers are in)."""
    max_connections: int = 256
    """Open connections (or requests in progress) beyond which a new request gets 503
    (uvicorn's limit_concurrency)."""
    max_messages: int = 4096
    """Messages (input items) in one request; more is a 400 naming the limit."""
    max_tools: int = 128
    """Tools offered in one request (OpenAI's own limit); more is a 400."""
    max_tools_kb: float = 1024.0
    """Total size of one request's tool definitions, as JSON, in KB (10^3 bytes)."""
    prompt_cache_gb: float = 2.0
    """Byte cap of the prompt (prefix KV) cache, in GB (10^9); 0 disables it."""
    memory_budget_gb: float | None = None
    """Memory the server may use (GB, 10^9); sets the max safe context. Default: 75% of RAM."""
    max_tokens: int = 1024
    """Completion length when a request gives none."""
    temperature: float | None = None
    """Default temperature (request > this > the model's generation_config.json > 1.0)."""
    top_p: float | None = None
    """Default nucleus mass (same precedence; fallback 1.0, off)."""
    top_k: int | None = None
    """Default top-k (same precedence; fallback 0, off)."""
    min_p: float | None = None
    """Default min-p (same precedence; fallback 0, off)."""
    prefill_step: int = 512
    """Prompt tokens per prefill chunk."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapters mounted at start, id -> adapter directory or training run directory (its final
    adapter): `adapters.chunk=outputs/chunk_seg4/<run>`."""
    adapter_root: str | None = None
    """Runtime mounts (POST /v1/adapters) must resolve inside this directory (symlinks followed),
    and GET /v1/adapters/available lists what is under it. Default: the runs directory `outputs/`
    under the working directory if it exists, else MLXLAB_HOME/adapters (created)."""
    allow_adapter_mount: bool = True
    """Allow POST/DELETE /v1/adapters."""
    runs_dir: str | None = None
    """Directory whose training runs the runs page (GET /runs, GET /v1/runs) lists and plots.
    Default: the adapter root, so a run's adapter can be mounted from the page."""
    drain_timeout_s: float = 30.0
    """On Ctrl-C/SIGTERM: how long in-flight requests may finish before the server exits."""
    log_requests: bool = False
    """Log one line per HTTP request."""
    openapi: bool = True
    """Serve GET /openapi.json, the server's schema (its routes, request models and error
    shapes: what API fuzzers such as schemathesis read); /docs stays off."""
    batch: int = 1
    """Rows decoded together by the continuous-batching lane; 1 serves one request at a time.
    Requests that cannot batch (explicit seed, repetition/presence/frequency penalties, KV
    quantization) take the serial lane between batches."""
    prefill_batch: int = 8
    """With batch > 1: prompts prefilled together (at most `batch`)."""
    speculative: str = "off"
    """Speculative decoding: off, prompt_lookup (drafts copied from the prompt and the answer so
    far where their last tokens recur: pays on answers that repeat or edit their prompt, JSON
    under a schema, code edits) or draft_model (drafts from `draft_model`). Drafts are verified
    k at a time in one forward pass; greedy answers are the plain decode's and sampled ones keep
    its distribution. Both lanes; /stats and /metrics count drafted and accepted tokens."""
    draft_tokens: int = 8
    """Draft tokens verified in one forward pass at most (1..15; fewer after a miss)."""
    draft_model: str | None = None
    """speculative=draft_model's drafts: a model with the same tokenizer (zoo name, directory,
    .gguf), or self:N (the model's own first N layers and its head: for tests; on a CPU it does
    not pay)."""
    kv_quant: str = "off"
    """KV-cache quantization: off, 4 or 8 (uniform bits, group 64), config (the model's
    kv_config.json: a list of {layer_idx, bits, group_size}) or a path to such a JSON file."""
    api_key: str | None = field(default=None, repr=False)
    """Key clients must send (`Authorization: Bearer <key>` or `x-api-key: <key>`) on every route
    but /health; default: the MLXLAB_API_KEY environment variable, else no key is required."""
    api_key_file: str | None = None
    """File of further API keys, one a line (`#` comments and blank lines ignored), one per client."""
    admin_key: str | None = field(default=None, repr=False)
    """If set (or MLXLAB_ADMIN_KEY), the only key that opens the routes that change the server's
    state (POST /v1/adapters, DELETE /v1/adapters/{id}); an API key gets 403 there."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header names accepted besides loopback ones (localhost, 127.0.0.1, [::1]) when bound to
    loopback; bound elsewhere, the only ones accepted if set. `*` accepts any:
    `allowed_hosts=[box.lan,10.0.0.5]`."""
    cors_origins: list[str] = field(default_factory=list)
    """Browser origins (scheme://host[:port]) that may call the API cross-origin and get CORS
    headers; others get 403 on POST/PUT/PATCH/DELETE. `*` allows any; the server's own origin is
    always allowed: `cors_origins=[http://localhost:3000]`."""
    # --- images, on a vision-language model (mlxlab/serve/vision.py) ---
    max_images: int = 5
    """Images in the last user message (the ones the model is shown); more is a 400."""
    max_image_mb: float = 20.0
    """Largest image, in MB of its file (a fetched URL's too); a larger one is a 413."""
    max_images_mb: float = 50.0
    """All the images of one request together (the history's too), in MB; more is a 413."""
    vision_body_mb: float = 72.0
    """Largest request body when the model has vision (base64 is 4/3 of the bytes: 50 MB of
    images is ~67 MB); a text-only model keeps max_body_mb, and the larger of the two applies."""
    allow_image_urls: bool = False
    """Fetch http(s) image URLs (off: data URLs and base64 sources only). A fetch is capped at
    max_image_mb and image_url_timeout_s, follows at most 3 redirects, and refuses any host that
    resolves to a loopback, private, link-local or other non-public address, on every hop."""
    image_url_timeout_s: float = 10.0
    """Deadline of one image URL's whole fetch (redirects included)."""
    image_url_hosts: list[str] = field(default_factory=list)
    """Host names (as written in URLs) that may resolve to private addresses, such as an image
    server on the LAN: `image_url_hosts=[images.lan]`; every other host must be public."""
    image_table: bool = True
    """Begin an answer about images with the filename table (`<!-- mlxk:filenames -->`) that
    keeps image ids stable when a client drops the images from its history."""
    image_exif: bool = True
    """The table's EXIF columns (Original, Location, Date, Camera); false: Image and Filename."""
    # Speech-to-text and embeddings (serve/audio, serve/embeddings), beside the chat model.
    stt_model: str | None = None
    """Speech-to-text model for /v1/audio/transcriptions, /v1/audio/translations and chat
    `input_audio` parts: `whisper-base` (zoo) or a converted Whisper directory; unset, those
    answer 400 saying how to set it."""
    embeddings_model: str | None = None
    """Sentence-embedding model for /v1/embeddings: `all-minilm-l6-v2` (zoo) or a converted
    BERT-family directory; unset, /v1/embeddings answers 400 saying how to set it."""
    stt_language: str | None = None
    """The language chat `input_audio` parts are spoken in (ISO 639-1 code or English name);
    unset: detected per part. The audio routes take theirs from the request's `language`."""
    max_audio_mb: float = 50.0
    """Largest request body on the audio routes (the uploaded file and its form), in MB
    (10^6 bytes): 413 above, spooled to disk below; replaces max_body_mb there."""
    max_chat_audio_mb: float = 5.0
    """Largest decoded `input_audio` part of a chat message, in MB (the body itself stays under
    max_body_mb)."""
    max_audio_s: float = 3600.0
    """Longest audio one request may decode to, in seconds (a small file can hold hours)."""

    def __post_init__(self):
        for name in ("max_audio_mb", "max_chat_audio_mb", "max_audio_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("stt_model", "embeddings_model", "stt_language"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                setattr(self, name, None)  # `stt_model=` on the command line: none
        check_choice("decode_head", self.decode_head, DECODE_HEADS)
        check_choice("dtype", self.dtype, DTYPES)
        if self.draft_model is not None and not str(self.draft_model).strip():
            self.draft_model = None
        check_mode(self.speculative, self.draft_model)
        if not 1 <= self.draft_tokens <= 15:
            raise UserError(f"draft_tokens must be in [1, 15], got {self.draft_tokens}")
        if not is_kv_quant(self.kv_quant):  # the wording kv_quant.parse uses for the same problem
            raise UserError(
                f"serve.kv_quant={self.kv_quant!r}: use off, 4, 8, config, or a kv_config.json path"
            )
        if not 0 < self.port < 65536:
            raise UserError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 1 or self.max_tokens < 1 or self.prefill_step < 1:
            raise UserError("max_queue, max_tokens and prefill_step must be >= 1")
        for name in ("max_body_mb", "read_timeout_s", "max_tools_kb"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections", "max_messages", "max_tools"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_cache_gb < 0:
            raise UserError(f"prompt_cache_gb must be >= 0, got {self.prompt_cache_gb}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise UserError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        for name, spec in (self.models or {}).items():
            if not str(name).strip() or not str(spec or "").strip():
                raise UserError(
                    f"serve.models.{name}={spec!r}: give each model a name and a spec "
                    "(models.small=tiny-llama)"
                )
            if str(name) == self.model and str(spec) != self.model:
                raise UserError(
                    f"serve.models.{name}={spec!r}: {name!r} is the default model's name "
                    f"(model={self.model}); give this model another name"
                )
        for name, adapters in (self.model_adapters or {}).items():
            spec = (self.models or {}).get(name)
            if spec is None or str(spec) == self.model:
                whose = (
                    "the default model's"
                    if str(name) == self.model or spec
                    else "not a served model's"
                )
                raise UserError(
                    f"serve.model_adapters.{name}: {name!r} is {whose} name; model_adapters "
                    "names a model of serve.models (the default model's adapters are "
                    "adapters.ID=PATH)"
                )
            if not hasattr(adapters, "items") or not all(
                str(k).strip() and str(v or "").strip() for k, v in adapters.items()
            ):
                raise UserError(
                    f"serve.model_adapters.{name}={adapters!r}: give each adapter an id and a "
                    f"path (model_adapters.{name}.chat=outputs/<run>)"
                )
        if self.model_idle_s < 0:
            raise UserError(f"model_idle_s must be >= 0, got {self.model_idle_s}")
        if not 0 < self.load_share <= 1:
            raise UserError(f"load_share must be in (0, 1], got {self.load_share}")
        if self.batch < 1 or self.prefill_batch < 1:
            raise UserError(
                f"batch and prefill_batch must be >= 1, got {self.batch} and {self.prefill_batch}"
            )
        self.kv_quant = str(self.kv_quant)
        for name in ("api_key", "admin_key"):
            if getattr(self, name) is not None:
                check_api_key(getattr(self, name), f"serve.{name}")
        if self.api_key_file is not None and not str(self.api_key_file).strip():
            raise UserError("serve.api_key_file is empty: give the path of a file of keys")
        for host in self.allowed_hosts:
            if not isinstance(host, str) or not host or re.search(r"[\s/]", host):
                raise UserError(
                    f"serve.allowed_hosts: {host!r} is not a host name or address "
                    "(a name, an IP address, or *)"
                )
        for origin in self.cors_origins:
            if not isinstance(origin, str) or not (origin == "*" or ORIGIN.fullmatch(origin)):
                raise UserError(
                    f"serve.cors_origins: {origin!r} is not an origin: scheme://host[:port] "
                    "without a path (http://localhost:3000), or *"
                )
        if self.max_images < 1:
            raise UserError(f"serve.max_images must be >= 1, got {self.max_images}")
        for name in ("max_image_mb", "max_images_mb", "vision_body_mb", "image_url_timeout_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"serve.{name} must be > 0, got {getattr(self, name)}")
        for host in self.image_url_hosts:
            if not isinstance(host, str) or not host or re.search(r"[\s/:]", host):
                raise UserError(
                    f"serve.image_url_hosts: {host!r} is not a host name (a name as it appears "
                    "in URLs, without scheme or port)"
                )

    def decode(self) -> DecodeSettings:
        """The decoder's settings (prefill steps, rows batched)."""
        return DecodeSettings(
            self.prefill_step,
            self.batch,
            self.prefill_batch,
            speculative=self.speculative,
            draft_tokens=self.draft_tokens,
        )

    def engine(self) -> EngineSettings:
        """The engine's settings: what loading and running the model needs."""
        return EngineSettings(
            model=self.model,
            dtype=self.dtype,
            decode_head=self.decode_head,
            memory_budget_gb=self.memory_budget_gb,
            kv_quant=self.kv_quant,
            prompt_cache_gb=self.prompt_cache_gb,
            draft_model=self.draft_model,
            adapters=dict(self.adapters or {}),
            adapter_root=self.adapter_root,
            stt_model=self.stt_model,
            stt_language=self.stt_language,
            embeddings_model=self.embeddings_model,
            max_queue=self.max_queue,
            models={str(k): str(v) for k, v in (self.models or {}).items()},
            model_adapters={
                str(m): {str(k): str(v) for k, v in a.items()}
                for m, a in (self.model_adapters or {}).items()
            },
            models_from_cache=self.models_from_cache,
            model_idle_s=self.model_idle_s,
            load_share=self.load_share,
            decode=self.decode(),
        )


@dataclass
class RunsConfig:
    """`python -m mlxlab runs`: the runs page on its own, without a model: the training runs under
    a directory, their metrics plotted as they train (`serve` has the same page at /runs)."""

    dir: str = "outputs"
    """Directory searched for training runs (run directories up to 4 levels down); the page
    reads nothing outside it."""
    host: str = "127.0.0.1"
    """Interface to bind (loopback by default)."""
    port: int = 8091
    """TCP port (one above serve's default, so both can run)."""
    api_key: str | None = field(default=None, repr=False)
    """Key the page's API calls must send, as on `serve` (default: MLXLAB_API_KEY, else none)."""
    api_key_file: str | None = None
    """File of further keys, one a line, as on `serve`."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header names accepted besides loopback ones, as on `serve`."""
    cors_origins: list[str] = field(default_factory=list)
    """Other browser origins that may call the API, as on `serve`."""

    def __post_init__(self):
        if not isinstance(self.dir, str) or not self.dir.strip():
            raise UserError("runs.dir is empty: give the directory holding the training runs")
        self.http()  # host, port, keys, hosts and origins checked as serve's are

    def http(self) -> ServeConfig:
        """The HTTP side's settings as `serve` holds them (for its guard and uvicorn settings),
        checked as `serve` checks them (its errors then name runs.<field>)."""
        try:
            return ServeConfig(
                host=self.host,
                port=self.port,
                api_key=self.api_key,
                api_key_file=self.api_key_file,
                allowed_hosts=list(self.allowed_hosts),
                cors_origins=list(self.cors_origins),
            )
        except UserError as e:
            raise UserError(str(e).replace("serve.", "runs.")) from None


ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", re.IGNORECASE)
"""A browser origin as an `Origin` header carries it: scheme://host[:port], no path."""


def check_api_key(key, where: str) -> None:
    """UserError unless `key` can travel in a header: printable ASCII without spaces (the message
    names where the key came from, never the key)."""
    if not isinstance(key, str) or not key or not all(33 <= ord(c) <= 126 for c in key):
        raise UserError(
            f"{where}: an API key must be a non-empty string of printable ASCII without spaces"
        )


registry.command("serve", ServeConfig)
registry.command("runs", RunsConfig)
