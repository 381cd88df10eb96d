"""Grammar-constrained decoding on llguidance: the output must match a JSON schema, a Lark
grammar or a regex, token by token.

    grammar = json_schema({"type": "object", ...})        # GrammarError (one line) if it cannot compile
    processor = constrain(grammar, tokenizer, n_vocab)    # an mlx-lm logits processor with state

`constrain` returns a fresh `Constraint` (its own matcher) per generated sequence: pass it in
`logits_processors` of mlx-lm's `generate_step`, or per row to its batch generators. Before each
sampling step it advances its matcher over the tokens sampled since its last call and sets every
token the grammar does not allow to -inf (the mask is computed on the CPU by llguidance and
applied with `mx.where`, so it works on CPU and Metal alike). Once the grammar is complete only
the end-of-sequence tokens stay allowed, so generation stops there; if max_tokens ends it first,
the text is a valid prefix.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np

from mlxlab.errors import UserError


class GrammarError(UserError, ValueError):
    """A schema or grammar llguidance cannot compile; the message names the problem."""


@dataclass(frozen=True)
class Grammar:
    """A compiled llguidance grammar (its serialized form) and what it is, for messages."""

    text: str
    what: str


def _checked(text: str, what: str) -> Grammar:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        first = messages[0].strip().splitlines() if messages else ["invalid grammar"]
        raise GrammarError(f"{what}: " + " ".join(line.strip() for line in first if line.strip()))
    return Grammar(text, what)


# Compact JSON with the separators json.dumps writes (no free whitespace: a small model given
# the choice pads with it until max_tokens).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema):
    """`schema` with `additionalProperties: false` wherever an object declares `properties` and
    says nothing about others: what is generated is then the declared properties only (still
    valid against the original schema), so a model cannot wander into unbounded extra keys."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k in _NESTED else v) for k, v in schema.items()}
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_NESTED = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then",
           "else", "contains")


def json_schema(schema: dict, what: str = "json schema") -> Grammar:
    """Output that parses as JSON and validates against `schema` (objects generate their declared
    properties only, see `closed`)."""
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError(f"{what}: a JSON schema must be an object")
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{what}: {e}") from None
    return _checked(text, what)


def json_object() -> Grammar:
    """Any JSON object."""
    return json_schema({"type": "object"}, "json object")


def lark(text: str, what: str = "grammar") -> Grammar:
    """A Lark grammar in llguidance's dialect (`%json {...}` embeds a schema)."""
    import llguidance

    return _checked(llguidance.LLMatcher.grammar_from_lark(text), what)


def embedded_json(schema: dict) -> str:
    """`schema` as a Lark rule body (`%json {...}`) in the same JSON style as `json_schema`."""
    schema = closed(schema)
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}})


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


def vocab_for(tokenizer, n_vocab: int):
    """llguidance's view of `tokenizer` (built once per tokenizer object: ~1 s on big vocabularies)."""
    import llguidance.hf

    key = getattr(tokenizer, "_tokenizer", tokenizer)
    cached = _VOCABS.get(key)
    if cached is None or cached[0] != n_vocab:
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [key.eos_token_id])
        cached = (n_vocab, llguidance.hf.from_tokenizer(key, n_vocab=n_vocab, eos_token=eos))
        _VOCABS[key] = cached
    return cached[1]


class Constraint:
    """An mlx-lm logits processor `(tokens, logits) -> logits` for one sequence."""

    def __init__(self, grammar: Grammar, vocab, n_vocab: int):
        import llguidance

        self.grammar, self.n_vocab = grammar, n_vocab
        self.matcher = llguidance.LLMatcher(vocab, grammar.text)
        self.mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.seen: int | None = None  # tokens of the context already accounted for
        self.steps = 0

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens sampled under this constraint."""
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                break  # error state: only end-of-sequence stays allowed

    def allowed(self) -> np.ndarray:
        """The allowed tokens, a bool per vocabulary entry."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def __call__(self, tokens, logits):
        import mlx.core as mx

        n = int(tokens.shape[-1]) if tokens is not None else 0
        if self.seen is not None and n > self.seen:
            self.advance(tokens.reshape(-1)[self.seen:].tolist())
        self.seen = n
        self.steps += 1
        allowed = mx.array(self.allowed())
        width = logits.shape[-1]
        if width > self.n_vocab:  # padded embedding rows are never allowed
            allowed = mx.concatenate([allowed, mx.zeros((width - self.n_vocab,), dtype=mx.bool_)])
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    @property
    def complete(self) -> bool:
        return self.matcher.is_accepting()


def constrain(grammar: Grammar, tokenizer, n_vocab: int) -> Constraint:
    """A fresh logits processor (its own matcher state) for one generated sequence."""
    return Constraint(grammar, vocab_for(tokenizer, n_vocab), n_vocab)
