"""JSON schemas and prompts for structured-output checks (tests/test_structured_real.py,
scripts/check_structured.py, and the HTTP tests of `response_format`).

`CASES` covers what clients send: nested objects, arrays with minItems/maxItems, enums, consts,
integers and numbers with bounds, required and optional fields, additionalProperties false,
strings with patterns and lengths, booleans, nullable fields, anyOf, nested arrays of objects,
arrays of arrays, a top-level array and a date format. Free strings carry a maxLength and arrays a
maxItems and every number a multipleOf, as real schemas usually do: nothing else bounds what a
small model writes inside them (gemma3-270m, greedy, fills an unbounded number with zeros,
`0.0000...`, until max_tokens).
Each case has three prompts; `messages(case, prompt)` is the chat that asks for it, with the
schema in the system prompt. `valid(text, schema)` is the verdict: the whole text (a code fence
around it allowed) is one JSON value that validates (jsonschema, formats checked).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


def _str(n: int = 40, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _obj(props: dict, required=None, **kw) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **kw,
    }


@dataclass(frozen=True)
class Case:
    name: str
    schema: dict
    prompts: tuple[str, str, str]


CASES: list[Case] = [
    Case(
        "person",
        _obj({"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        ("Describe Ada Lovelace.", "Invent a customer for a bakery.", "Who wrote Hamlet?"),
    ),
    Case(
        "product",
        _obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.01},
                "in_stock": {"type": "boolean"},
            }
        ),
        (
            "A wireless mouse that sells for 25 dollars.",
            "List a product from a hardware store.",
            "An out-of-stock laptop.",
        ),
    ),
    Case(
        "sentiment",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
            }
        ),
        (
            "Classify: 'I love this phone, the battery lasts forever.'",
            "Classify: 'The delivery was late and the box was crushed.'",
            "Classify: 'The meeting is at 3 pm.'",
        ),
    ),
    Case(
        "todo",
        _obj({"items": {"type": "array", "items": _str(), "minItems": 2, "maxItems": 4}}),
        ("Plan my Saturday morning.", "Steps to bake bread.", "Things to pack for a beach trip."),
    ),
    Case(
        "address",
        _obj(
            {
                "street": _str(),
                "city": _str(30),
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR", "JP"]},
            }
        ),
        ("The White House's address.", "A made-up address in Berlin.", "An address in Paris."),
    ),
    Case(
        "order",
        _obj(
            {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "customer": _obj(
                    {
                        "name": _str(),
                        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
                    }
                ),
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                        }
                    ),
                },
            }
        ),
        (
            "Bob ordered two keyboards.",
            "Order 42: one lamp for Alice.",
            "A customer buys three books.",
        ),
    ),
    Case(
        "weather",
        _obj(
            {
                "city": _str(30),
                "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "wind_kph": {"type": "integer", "minimum": 0, "maximum": 200},
            },
            required=["city", "temperature_c", "conditions"],
        ),
        ("Weather in Oslo in January.", "A hot day in Cairo.", "Rainy London."),
    ),
    Case(
        "yes_no",
        _obj({"answer": {"type": "boolean"}, "reason": _str(80)}),
        ("Is the Earth round?", "Can fish fly?", "Is Python a programming language?"),
    ),
    Case(
        "tags",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"enum": ["python", "rust", "web", "data", "ml", "devops"]},
                }
            }
        ),
        (
            "Tag this post: 'Training a neural network with PyTorch'.",
            "Tag this post: 'Deploying a Flask app with Docker'.",
            "Tag this post: 'Memory safety without GC'.",
        ),
    ),
    Case(
        "color",
        _obj(
            {
                "name": _str(20),
                "rgb": {
                    "type": "array",
                    "minItems": 3,
                    "maxItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 255},
                },
            }
        ),
        ("The color of the sky.", "Pure red.", "A dark green."),
    ),
    Case(
        "event",
        _obj(
            {
                "title": _str(),
                "date": {"type": "string", "format": "date"},
                "attendees": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {"name": _str(20), "role": {"enum": ["host", "speaker", "guest"]}}
                    ),
                },
            }
        ),
        (
            "A product launch on 2024-05-01 hosted by Dana.",
            "A birthday party next spring.",
            "A conference talk by Lee.",
        ),
    ),
    Case(
        "matrix",
        _obj(
            {
                "matrix": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            }
        ),
        ("The 2x2 identity matrix.", "A 2x2 matrix of small digits.", "A 2x2 matrix of zeros."),
    ),
    Case(
        "movie",
        _obj(
            {
                "title": _str(),
                "subtitle": _str(),
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            },
            required=["title"],
        ),
        ("The first Star Wars film.", "A famous film from 1994.", "Any movie you like."),
    ),
    Case(
        "book",
        _obj(
            {
                "title": _str(),
                "author": _obj({"first": _str(20), "last": _str(20)}),
                "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                "genres": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {"enum": ["fiction", "history", "science", "poetry"]},
                },
            }
        ),
        ("Describe 'A Brief History of Time'.", "A poetry collection.", "A novel by Jane Austen."),
    ),
    Case(
        "coordinates",
        _obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
                "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001},
            }
        ),
        ("Where is Tokyo?", "Coordinates of the North Pole.", "Where is New York?"),
    ),
    Case(
        "version",
        _obj(
            {
                "major": {"type": "integer", "minimum": 0, "maximum": 99},
                "minor": {"type": "integer", "minimum": 0, "maximum": 99},
                "patch": {"type": "integer", "minimum": 0, "maximum": 99},
                "prerelease": {"type": "string", "pattern": "^(alpha|beta|rc)[0-9]$"},
            },
            required=["major", "minor", "patch"],
        ),
        (
            "Version 3.12.1 of a library.",
            "A beta release of version 2.",
            "The first stable release.",
        ),
    ),
    Case(
        "recipe",
        _obj(
            {
                "name": _str(),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "item": _str(20),
                            "grams": {"type": "integer", "minimum": 1, "maximum": 1000},
                        }
                    ),
                },
                "vegetarian": {"type": "boolean"},
            }
        ),
        ("A simple pancake recipe.", "Tomato soup for four.", "A steak dinner."),
    ),
    Case(
        "quiz",
        _obj(
            {
                "question": _str(80),
                "choices": {"type": "array", "minItems": 4, "maxItems": 4, "items": _str(20)},
                "answer_index": {"type": "integer", "minimum": 0, "maximum": 3},
            }
        ),
        (
            "A quiz question about planets.",
            "A quiz question about capitals.",
            "A quiz question about math.",
        ),
    ),
    Case(
        "profile",
        _obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "settings": _obj(
                    {
                        "theme": {"enum": ["light", "dark"]},
                        "notifications": {"type": "boolean"},
                        "language": {"enum": ["en", "de", "fr"]},
                    }
                ),
            }
        ),
        ("A user who likes dark mode.", "A German user.", "A new account with default settings."),
    ),
    Case(
        "shape",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj(
                            {
                                "kind": {"const": "circle"},
                                "radius": {"type": "integer", "minimum": 1, "maximum": 100},
                            }
                        ),
                        _obj(
                            {
                                "kind": {"const": "square"},
                                "side": {"type": "integer", "minimum": 1, "maximum": 100},
                            }
                        ),
                    ]
                }
            }
        ),
        ("A circle of radius 5.", "A square with side 3.", "Any shape."),
    ),
    Case(
        "status",
        _obj({"status": {"const": "ok"}, "code": {"enum": [200, 201, 204]}}),
        (
            "The response to a successful GET.",
            "The response to a created resource.",
            "An empty success.",
        ),
    ),
    Case(
        "task_list",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": _obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 100},
                    "done": {"type": "boolean"},
                }
            ),
        },
        ("Two tasks, the first one finished.", "One open task.", "Three tasks, none done."),
    ),
    Case(
        "nickname",
        _obj({"name": _str(30), "nickname": {"type": ["string", "null"], "maxLength": 20}}),
        ("Robert, called Bob.", "Someone without a nickname.", "Elizabeth, called Liz."),
    ),
]

SYSTEM = "Reply with JSON only, no other text. The JSON must validate against this JSON schema:\n{schema}"


def messages(case: Case, prompt: str) -> list[dict]:
    """The chat asking for `case`'s JSON (schema in the system prompt)."""
    return [
        {"role": "system", "content": SYSTEM.format(schema=json.dumps(case.schema))},
        {"role": "user", "content": prompt},
    ]


def parse(text: str):
    """The JSON value `text` is (surrounding whitespace and one code fence allowed); ValueError if none."""
    text = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    return json.loads(fenced.group(1) if fenced else text)


def _multiple_of(validator, step, instance, schema):
    """multipleOf on the numbers' decimal forms: jsonschema divides floats (0.29 / 0.01 is
    28.999999999999996, so it would reject 0.29)."""
    from fractions import Fraction

    from jsonschema import ValidationError

    if validator.is_type(instance, "number"):
        if (Fraction(str(instance)) / Fraction(str(step))).denominator != 1:
            yield ValidationError(f"{instance!r} is not a multiple of {step}")


def validator(schema: dict):
    """A Draft 2020-12 validator for `schema`: formats checked, multipleOf exact."""
    import jsonschema

    cls = jsonschema.validators.extend(
        jsonschema.Draft202012Validator, {"multipleOf": _multiple_of}
    )
    return cls(schema, format_checker=jsonschema.FormatChecker())


def valid(text: str, schema: dict) -> bool:
    """`text` is one JSON value that validates against `schema` (formats checked)."""
    try:
        value = parse(text)
    except ValueError:
        return False
    return validator(schema).is_valid(value)


def problem(text: str, schema: dict) -> str | None:
    """Why `text` is not valid (None when it is), for failure messages."""
    try:
        value = parse(text)
    except ValueError as e:
        return f"not JSON: {e}"
    errors = sorted(validator(schema).iter_errors(value), key=lambda e: list(e.path))
    return f"{list(errors[0].path)}: {errors[0].message}" if errors else None


def settled_invalid(text: str) -> bool:
    """True once no continuation of `text` can be `valid` for a schema whose top level is an
    object or an array: it opens with anything but `{`, `[` or a code fence, or a complete JSON
    value is followed by something other than whitespace or the closing fence. Lets an
    unconstrained decode stop early without changing its verdict."""
    body = text.lstrip()
    if not body:
        return False
    fence = False
    if body.startswith("`"):
        if not body.startswith("```"):
            return not "```".startswith(body)
        fence = True
        body = re.sub(r"^```(json)?", "", body).lstrip()
        if not body or "json".startswith(body):
            return False
    if body[0] not in "{[":
        return True
    try:
        _, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return False  # not complete yet (or broken in a way only a parser would see)
    rest = body[end:].strip()
    if not rest:
        return False
    return not (fence and "```".startswith(rest[:3]) and rest[3:].strip() == "")


def decode(
    model,
    tokenizer,
    case: Case,
    prompt: str,
    constrained: bool,
    max_tokens: int = 256,
    cache=None,
    ids: list[int] | None = None,
) -> dict:
    """Greedy decode of `messages(case, prompt)` with mlx-lm's `generate_step`; constrained: under
    `case.schema` through `mlxlab.grammar.constrain`. `cache` (a prompt cache that already holds
    all of the prompt's tokens but the last, `ids` the prompt's tokens) skips that prefill; it is
    consumed. {"text", "finish": "eos" | "length" | "settled" (unconstrained, stopped once
    `settled_invalid`), "tokens"}."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxlab import grammar

    processors = None
    if constrained:
        width = int(getattr(model.args, "vocab_size", 0) or len(tokenizer._tokenizer))
        processors = [
            grammar.constrain(grammar.json_schema(case.schema, case.name), tokenizer, width)
        ]
    if ids is None:
        ids = tokenizer.apply_chat_template(messages(case, prompt), add_generation_prompt=True)
    feed = ids[-1:] if cache is not None else ids
    eos = set(tokenizer.eos_token_ids)
    tokens: list[int] = []
    finish = "length"
    steps = generate_step(
        mx.array(feed),
        model,
        max_tokens=max_tokens,
        logits_processors=processors,
        prompt_cache=cache,
    )
    for tok, _ in steps:
        if tok in eos:
            finish = "eos"
            break
        tokens.append(tok)
        if not constrained and len(tokens) % 4 == 0 and settled_invalid(tokenizer.decode(tokens)):
            finish = "settled"
            break
    steps.close()
    return {"text": tokenizer.decode(tokens), "finish": finish, "tokens": len(tokens)}


SIDES = ("constrained", "unconstrained")


def decode_case(
    model, tokenizer, case: Case, sides=SIDES, max_tokens: int = 256, prompts=None
) -> list[dict]:
    """`decode` of each of the case's prompts (or `prompts`) once per side in `sides`, with the
    prefill shared: the prompts' common prefix (system prompt and schema) is computed once, each
    prompt's rest once for all its sides. One dict per prompt: {"prompt", "constrained": ...,
    "unconstrained": ...}."""
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def prefill(cache, tokens):
        if tokens:
            model(mx.array(tokens)[None], cache=cache)
            mx.eval([c.state for c in cache])

    ids = [
        tokenizer.apply_chat_template(messages(case, p), add_generation_prompt=True)
        for p in prompts or case.prompts
    ]
    n = 0
    while n < min(len(i) for i in ids) - 1 and len({i[n] for i in ids}) == 1:
        n += 1
    shared = make_prompt_cache(model)
    prefill(shared, ids[0][:n])
    rows = []
    for prompt, full in zip(prompts or case.prompts, ids, strict=True):
        cache = copy.deepcopy(shared)
        prefill(cache, full[n:-1])
        row = {"prompt": prompt}
        for side in sides:
            held = side == "constrained"
            row[side] = decode(
                model, tokenizer, case, prompt, held, max_tokens, copy.deepcopy(cache), full
            )
        rows.append(row)
    return rows


def decode_batch(
    model,
    tokenizer,
    items: list[tuple[Case, str]],
    constrained: bool,
    max_tokens: int = 256,
    rows: int = 16,
) -> list[dict]:
    """`decode` of many (case, prompt) pairs at once on mlx-lm's `BatchGenerator` (continuous
    batching, up to `rows` together, greedy), each constrained row with its own constraint (rows
    of different schemas share a batch). Same result dicts, in order."""
    from mlx_lm.generate import BatchGenerator

    from mlxlab import grammar

    width = int(getattr(model.args, "vocab_size", 0) or len(tokenizer._tokenizer))
    prompts = [
        tokenizer.apply_chat_template(messages(c, p), add_generation_prompt=True) for c, p in items
    ]
    processors = None
    if constrained:
        processors = [
            [grammar.constrain(grammar.json_schema(c.schema, c.name), tokenizer, width)]
            for c, _ in items
        ]
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=rows,
        prefill_batch_size=min(rows, 8),
    )
    try:
        uids = gen.insert(prompts, [max_tokens] * len(prompts), logits_processors=processors)
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        while responses := gen.next_generated():
            settled = []
            for r in responses:
                if r.finish_reason == "stop":
                    finish[r.uid] = "eos"
                    continue
                tokens[r.uid].append(r.token)
                if r.finish_reason == "length":
                    finish[r.uid] = "length"
                elif not constrained and len(tokens[r.uid]) % 4 == 0:
                    if settled_invalid(tokenizer.decode(tokens[r.uid])):
                        finish[r.uid] = "settled"
                        settled.append(r.uid)
            if settled:
                gen.remove(settled)
    finally:
        gen.close()
    return [
        {
            "text": tokenizer.decode(tokens[u]),
            "finish": finish.get(u, "length"),
            "tokens": len(tokens[u]),
        }
        for u in uids
    ]
