"""Grammar-constrained decoding on llguidance: the output must match a JSON schema or a Lark
grammar, token by token.

    grammar = json_schema({"type": "object", ...})        # GrammarError (one line) if it cannot compile
    processor = constrain(grammar, tokenizer, n_vocab)    # an mlx-lm logits processor with state

`constrain` returns a fresh `Constraint` (its own matcher) per generated sequence: pass it in
`logits_processors` of mlx-lm's `generate_step`, or per row to its batch generators. Before each
sampling step it advances its matcher over the tokens sampled since its last call and sets every
token the grammar does not allow to -inf (the mask is computed on the CPU by llguidance and
applied with `mx.where`, so it works on CPU and Metal alike). Once the grammar is complete only
the end-of-sequence tokens stay allowed, so generation stops there; if max_tokens (or a stop
string) ends it first, the text is a valid prefix.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from mlxlab.errors import UserError

log = logging.getLogger(__name__)


class GrammarError(UserError, ValueError):
    """A schema or grammar llguidance cannot compile; the message names the problem."""


@dataclass(frozen=True)
class Grammar:
    """A compiled llguidance grammar (its serialized form) and what it is, for messages."""

    text: str
    what: str


@functools.lru_cache(maxsize=256)
def _problem(text: str) -> str | None:
    """Why llguidance cannot compile `text` (one line), or None; cached, so a repeated schema is
    checked once."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if not is_error:
        return None
    lines = [
        line.strip()
        for line in (messages[0] if messages else "invalid grammar").splitlines()
        if line.strip()
    ]
    message = " ".join(lines)
    return message if len(message) <= 300 else message[:297] + "..."


def _checked(text: str, what: str) -> Grammar:
    problem = _problem(text)
    if problem:
        raise GrammarError(f"{what}: {problem}")
    return Grammar(text, what)


# Compact JSON with the separators json.dumps writes (no free whitespace: a small model given
# the choice pads with it until max_tokens).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Where closing objects could change what is valid (an allOf branch closed against its sibling's
# properties, a negation, a conditional, a reference from such a place): leave the schema as is.
_NO_CLOSING = (
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "$ref",
    "dependentSchemas",
    "unevaluatedProperties",
)


def _mentions(schema, keys) -> bool:
    if isinstance(schema, dict):
        return any(k in schema for k in keys) or any(_mentions(v, keys) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(v, keys) for v in schema)
    return False


class RecursiveRef(GrammarError):
    """A schema whose local `$ref`s refer back to themselves: it cannot be inlined."""


# Where a schema holds schemas (JSON Schema 2020-12 and draft 7): a walk that rewrites
# references goes there only, so a property named `$ref`, `enum` or `definitions` is a name.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items",  # a schema, or (draft 7) a list of them
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_ANNOTATIONS = ("title", "description", "$comment", "default", "examples")
MAX_INLINED_NODES = 20_000


def _subschemas(node: dict, fn) -> dict:
    """`node` with `fn` applied to each schema it holds (every other value as it is)."""
    out = {}
    for k, v in node.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: fn(sub) for name, sub in v.items()}
        elif (k in _SCHEMA_LISTS or k == "items") and isinstance(v, list):
            out[k] = [fn(sub) for sub in v]
        elif k in _SCHEMA_ONE:
            out[k] = fn(v)
        else:
            out[k] = v
    return out


def _pointer(root, ref: str, what: str):
    """What the local reference `ref` ("#", "#/$defs/x", "#/properties/a/items") points to."""
    from urllib.parse import unquote

    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise GrammarError(f"{what}: $ref {ref!r} points at nothing in the schema") from None
    return node


def _is_local(ref) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def inline_refs(schema, what: str = "json schema"):
    """`schema` with every local `$ref` ("#", "#/...") replaced by what it points to (`$defs`
    and `definitions` then dropped), so that a part of it stands alone (a tool's parameters
    embedded in a call's grammar, where `#/...` would resolve against the call) and `closed`
    can close its objects. A reference beside other keywords becomes `allOf` when they overlap.
    A schema without local references is returned as it is; a recursive one raises
    `RecursiveRef`; one that grows past MAX_INLINED_NODES once inlined, or whose references
    point at nothing, raises GrammarError."""
    try:
        if not _has_local_ref(schema):
            return schema
    except RecursionError:
        raise GrammarError(f"{what}: the schema is nested too deeply") from None
    count = 0

    def walk(node, stack):
        nonlocal count
        count += 1
        if count > MAX_INLINED_NODES:
            raise GrammarError(f"{what}: the schema is too large once its $refs are inlined")
        if not isinstance(node, dict):
            return node
        out = _subschemas(node, lambda sub: walk(sub, stack))
        out.pop("$defs", None), out.pop("definitions", None)
        ref = out.pop("$ref", None)
        if ref is None:
            return out
        if not _is_local(ref):
            return {**out, "$ref": ref}  # not local: left for llguidance to resolve or refuse
        if ref in stack:
            raise RecursiveRef(f"{what}: $ref {ref!r} refers to itself (a recursive schema)")
        target = walk(_pointer(schema, ref, what), stack | {ref})
        if not isinstance(target, dict):  # true / false schemas
            return target if not out else {"allOf": [target, out]}
        checks = {k: v for k, v in out.items() if k not in _ANNOTATIONS}
        if set(checks) & set(target):
            return {"allOf": [target, checks], **{k: out[k] for k in out if k not in checks}}
        return {**target, **out}

    try:
        return walk(schema, frozenset())
    except RecursionError:
        raise GrammarError(f"{what}: the schema is nested too deeply") from None


def _has_local_ref(node) -> bool:
    return bool(_local_refs(node, set()))


def _local_refs(node, into: set) -> set:
    """The local references in `node` and the schemas it holds, added to `into`."""
    if isinstance(node, dict):
        if _is_local(node.get("$ref")):
            into.add(node["$ref"])
        _subschemas(node, lambda sub: _local_refs(sub, into))
    return into


def has_finite_value(schema) -> bool:
    """Whether some finite JSON value can satisfy `schema`'s structure: False when a chain of
    local `$ref`s must recurse forever (`{"properties": {"a": {"$ref": "#"}}, "required":
    ["a"]}`), which a grammar cannot end. A least fixpoint over the references (each assumed
    unsatisfiable until shown otherwise); constraints other than structure are not judged, and
    a schema too malformed to judge counts as finite (llguidance judges it)."""
    refs: dict[str, bool] = {}

    def finite(node) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if _is_local(ref) and not refs.get(ref, False):
            return False
        if any(not finite(s) for s in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            if _list(node.get(key)) and not any(finite(s) for s in _list(node[key])):
                return False
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if any(k in props and not finite(props[k]) for k in _list(node.get("required"))):
            return False
        items, least = node.get("items"), node.get("minItems")
        if isinstance(items, dict) and isinstance(least, int) and least > 0:
            return finite(items)
        return True

    try:
        names = _local_refs(schema, set())
        changed = True
        while changed:
            changed = False
            for ref in names:
                if not refs.get(ref):
                    try:
                        ok = finite(_pointer(schema, ref, "schema"))
                    except GrammarError:
                        ok = False
                    if ok:
                        refs[ref], changed = True, True
        return finite(schema)
    except (TypeError, ValueError, AttributeError, RecursionError):
        return True


def _list(value) -> list:
    return value if isinstance(value, list) else []


def closed(schema):
    """`schema` with `additionalProperties: false` wherever an object declares `properties` and
    says nothing about others: what is generated is then the declared properties only (still
    valid against the original schema), so a model cannot wander into unbounded extra keys.
    Schemas using allOf, not, if/then/else or $ref are returned as they are."""
    if _mentions(schema, _NO_CLOSING):
        return schema
    return _close(schema)


def _close(schema):
    if isinstance(schema, list):
        return [_close(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_close(v) if k in _NESTED else v) for k, v in schema.items()}
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s) for name, s in out[key].items()}
    if (
        isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


_NESTED = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "contains")


def json_schema(schema: dict, what: str = "json schema") -> Grammar:
    """Output that parses as JSON and validates against `schema` (objects generate their declared
    properties only, see `closed`, after local `$ref`s are inlined unless they recurse)."""
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError(f"{what}: a JSON schema must be an object")
    recursive = False
    try:
        flat = inline_refs(schema, what)
    except RecursiveRef:  # llguidance follows a recursive reference from the schema's root
        flat, recursive = schema, True
    except GrammarError:  # (llguidance resolves the references itself, or says what is wrong)
        flat = schema
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(closed(flat), defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{what}: {e}") from None
    except RecursionError:  # `closed` walks the schema: deeper than Python's stack
        raise GrammarError(f"{what}: the schema is nested too deeply") from None
    grammar = _checked(text, what)
    if recursive and not has_finite_value(schema):  # it compiles, and then cannot end
        raise GrammarError(
            f"{what}: its $refs recurse without end (no finite JSON value satisfies it)"
        )
    return grammar


# What llguidance cannot enforce in a schema that is still a JSON schema: regex features it lacks
# (look-around, backreferences), references it does not fetch, constraints no value satisfies.
# (Compiling leniently already passes keywords it has not implemented and unknown formats.)
_UNENFORCEABLE = (
    "regex parse error",
    "Resource ",
    "Unsatisfiable schema",
    "Unimplemented",
    "Unknown format",
)


def schema_problem(schema, what: str = "json schema") -> str | None:
    """Why `schema` is not a JSON schema at all (one line: a keyword of the wrong kind, an
    unknown type name, ...), or None; what llguidance merely cannot enforce in it is no problem
    here (`json_schema` is the check for a schema that must be enforced). Cheap: llguidance
    checks each distinct schema once."""
    import llguidance

    if not isinstance(schema, dict):
        return f"{what}: a JSON schema must be an object"
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"lenient": True})
    except (ValueError, TypeError) as e:
        return f"{what}: {e}"
    problem = _problem(text)
    return None if problem is None or problem.startswith(_UNENFORCEABLE) else f"{what}: {problem}"


def lark(text: str, what: str = "grammar") -> Grammar:
    """A Lark grammar in llguidance's dialect (`%json {...}` embeds a schema)."""
    import llguidance

    return _checked(llguidance.LLMatcher.grammar_from_lark(text), what)


def embedded_json(schema: dict) -> str:
    """`schema` as a Lark rule body (`%json {...}`) in the same JSON style as `json_schema`
    (its `$ref`s resolve against `schema` itself: pass a whole schema, or one `inline_refs`
    made stand alone)."""
    try:
        schema = inline_refs(schema)
    except RecursiveRef:
        pass
    schema = closed(schema)
    return "%json " + json.dumps(
        {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}
    )


def literal(text: str, tokenizer) -> str:
    """`text` as a Lark terminal: a special token by id when the tokenizer has it as one (such
    tokens never match as plain text), else a quoted string."""
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    for tid, tok in (getattr(backend, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            special.add(int(tid))
    if len(ids) == 1 and ids[0] in special:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocab_for(tokenizer, n_vocab: int):
    """llguidance's view of `tokenizer`, built once per tokenizer object (thread-safe; slow on big
    vocabularies: 4-8 s for Gemma 3's 262k tokens on the 2-core CPU, so a server builds it while
    it loads)."""
    import llguidance.hf

    key = getattr(tokenizer, "_tokenizer", tokenizer)
    with _VOCABS_LOCK:
        cached = _VOCABS.get(key)
        if cached is None or cached[0] != n_vocab:
            eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [key.eos_token_id])
            cached = (n_vocab, llguidance.hf.from_tokenizer(key, n_vocab=n_vocab, eos_token=eos))
            _VOCABS[key] = cached
    return cached[1]


class Constraint:
    """An mlx-lm logits processor `(tokens, logits) -> logits` for one sequence. With `watch` it
    also records where the grammar overruled the model (`refused`)."""

    def __init__(self, grammar: Grammar, vocab, n_vocab: int, watch: bool = False):
        import llguidance

        self.n_vocab = n_vocab
        self.watch = watch
        self.matcher = llguidance.LLMatcher(vocab, grammar.text, log_level=0)
        if (
            self.matcher.is_error()
        ):  # checked grammars compile; this would allow only end-of-sequence
            log.warning(
                "mlxlab: %s did not compile for this tokenizer: %s",
                grammar.what,
                self.matcher.get_error(),
            )
        self.mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.seen: int | None = None  # tokens of the context already accounted for
        # per step that chose a token while the answer was open, whether the grammar refused
        # the model's top token there (the last step's flag pending: read at the next call)
        self._refused: list[bool] = []
        self._pending = None
        # per call, most recent last: (context growth, tokens consumed, whether it settled a flag)
        # so that a speculative decoder can take back calls made for drafts it rejected
        self._calls: list[tuple[int, int, bool]] = []

    def advance(self, tokens: list[int]) -> int:
        """Consume tokens sampled under this constraint; how many it took."""
        for i, t in enumerate(tokens):
            if not self.matcher.consume_token(int(t)):
                return i  # error state: only end-of-sequence stays allowed
        return len(tokens)

    # --- speculative decoding (decode/speculative.py) ---

    def draft(self, ahead: list[int], k: int, propose) -> tuple[list[int], int]:
        """Up to k draft tokens to follow `ahead` (tokens sampled but not yet seen by a call) and
        how many of them the grammar forces: its fast-forward tokens (llguidance's: the only
        continuation it allows, e.g. a JSON key or a tool call's opening), then
        `propose(forced, n)`'s, cut before the first one the grammar refuses. The matcher is left
        as it was."""
        m = self.matcher
        if k < 1 or m.is_error():
            return [], 0
        n = m.try_consume_tokens([int(t) for t in ahead])
        try:
            if n < len(ahead) or m.is_stopped():
                return [], 0
            forced = [int(t) for t in m.compute_ff_tokens()[:k]]
            tokens = forced + [int(t) for t in propose(forced, k - len(forced))]
            ok = m.validate_tokens(tokens)
            return tokens[:ok], min(len(forced), ok)
        finally:
            m.rollback(n)

    def allowed_prefix(self, ahead: list[int], tokens: list[int]) -> int:
        """How many leading `tokens` the grammar allows after `ahead` (the matcher is left as it
        was)."""
        m = self.matcher
        n = m.try_consume_tokens([int(t) for t in ahead])
        try:
            return m.validate_tokens([int(t) for t in tokens]) if n == len(ahead) else 0
        finally:
            m.rollback(n)

    def rewind(self, calls: int) -> None:
        """Take back the last `calls` calls (a verify step's positions past the drafts it
        rejected): the matcher rolls back the tokens they consumed, their refusal flags go, and
        the flag of the last call kept is pending again (its token is written now)."""
        if calls <= 0:
            return
        if calls > len(self._calls):
            raise ValueError(f"cannot take back {calls} calls, {len(self._calls)} are recorded")
        taken = self._calls[-calls:]
        del self._calls[-calls:]
        grown = sum(c[0] for c in taken)
        consumed = sum(c[1] for c in taken)
        settled = sum(c[2] for c in taken)
        if consumed:
            self.matcher.rollback(consumed)
        self.seen = (self.seen or 0) - grown
        self._pending = None
        if settled:
            import mlx.core as mx

            flags = self._refused[-settled:]
            del self._refused[-settled:]
            self._pending = mx.array(flags[0])

    def allowed(self) -> np.ndarray:
        """The allowed tokens, a bool per vocabulary entry."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        n = int(tokens.shape[-1]) if tokens is not None else 0
        grown = consumed = 0
        settled = False
        if self.seen is not None and n > self.seen:
            grown = n - self.seen
            consumed = self.advance(tokens.reshape(-1)[self.seen :].tolist())
            settled = self._settle()  # the step before wrote a token: its flag counts
        self.seen = n
        self._calls.append((grown, consumed, settled))
        if len(self._calls) > 256:
            del self._calls[:128]
        self._pending = None  # (a step asked again: only its last ask counts)
        allowed = self.allowed()
        width = logits.shape[-1]
        if width > self.n_vocab:  # padded embedding rows are never allowed
            allowed = np.concatenate([allowed, np.zeros(width - self.n_vocab, dtype=bool)])
        keep = mx.array(allowed[:width])
        # stopped: only the end is left to write (an error state is watched: it refuses all)
        if self.watch and (self.matcher.is_error() or not self.matcher.is_stopped()):
            assert logits.size == width, "one sequence's logits"
            self._pending = mx.logical_not(keep[mx.argmax(logits.reshape(-1))])
        return mx.where(keep, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def _settle(self) -> bool:
        # the step before's flag: its logits are computed by now (its token was read), and
        # reading it here frees them
        if self._pending is not None:
            self._refused.append(bool(self._pending.item()))
            self._pending = None
            return True
        return False

    def refused(self) -> list[int]:
        """The steps (0 = the answer's first token) at which the model's own top token, the one
        it would have written unconstrained, was one the grammar refused, so the token written
        there was the grammar's choice among what it allowed (with `watch`; without, none).
        Steps after the grammar has closed the answer (only the end left to write) are not
        counted. Call it once the sequence is done: a step counts once the next call shows its
        token written, so the step mlx-lm's loops compute past a sequence cut at max_tokens
        (never written) is dropped here, with its logits."""
        self._pending = None
        return [i for i, r in enumerate(self._refused) if r]


def constrain(grammar: Grammar, tokenizer, n_vocab: int, watch: bool = False) -> Constraint:
    """A fresh logits processor (its own matcher state) for one generated sequence; `watch`:
    it records the steps where the grammar refused the model's top token (`refused`)."""
    return Constraint(grammar, vocab_for(tokenizer, n_vocab), n_vocab, watch)
