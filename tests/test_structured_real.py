"""Grammar-constrained decoding on the real model: every schema in tests/helpers/schemas.py x
its three prompts, greedy, with `mlxlab.grammar.constrain`; every answer must end at
end-of-sequence, parse and validate (jsonschema). The first prompt of each schema is decoded
with mlx-lm's `generate_step` (the serial lane's decoder), the other two together on mlx-lm's
`BatchGenerator`, every row with its own constraint and rows of different schemas in one batch
(the batched lane's per-row processors); that keeps the run to a few minutes. The same prompts
without the constraint must validate far less often (the base model rarely answers with bare
JSON). `python scripts/check_structured.py` prints both rates.
"""

from __future__ import annotations

import pytest

import mlxlab  # noqa: F401
from tests.helpers import schemas

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

BATCHED = [(case, prompt) for case in schemas.CASES for prompt in case.prompts[1:]]
VALID = {"constrained": {}, "unconstrained": {}}  # side -> {(schema, prompt): valid}


@pytest.fixture(scope="module")
def loaded(real_model_dir):
    from mlxlab.models.zoo import load

    return load(str(real_model_dir))


def _why_not(case, out: dict) -> str | None:
    if out["finish"] != "eos":
        return f"stopped by {out['finish']} after {out['tokens']} tokens"
    return schemas.problem(out["text"], case.schema)


def test_the_schemas_are_many_and_well_formed():
    import jsonschema

    assert len(schemas.CASES) >= 20 and all(len(c.prompts) == 3 for c in schemas.CASES)
    assert len({c.name for c in schemas.CASES}) == len(schemas.CASES)
    for case in schemas.CASES:
        jsonschema.Draft202012Validator.check_schema(case.schema)


@pytest.mark.parametrize("case", schemas.CASES, ids=[c.name for c in schemas.CASES])
def test_generate_step_answer_ends_and_validates(loaded, case):
    model, tokenizer = loaded
    (row,) = schemas.decode_case(model, tokenizer, case, max_tokens=256, prompts=case.prompts[:1])
    for side in schemas.SIDES:
        VALID[side][case.name, row["prompt"]] = schemas.valid(row[side]["text"], case.schema)
    why = _why_not(case, row["constrained"])
    assert why is None, f"{case.name}, {row['prompt']!r}: {why}: {row['constrained']['text']!r}"


def test_batched_answers_end_and_validate(loaded):
    model, tokenizer = loaded
    held = schemas.decode_batch(model, tokenizer, BATCHED, constrained=True, max_tokens=256)
    free = schemas.decode_batch(model, tokenizer, BATCHED, constrained=False, max_tokens=256)
    failures = []
    for (case, prompt), h, f in zip(BATCHED, held, free, strict=True):
        VALID["constrained"][case.name, prompt] = schemas.valid(h["text"], case.schema)
        VALID["unconstrained"][case.name, prompt] = schemas.valid(f["text"], case.schema)
        if why := _why_not(case, h):
            failures.append(f"{case.name}, {prompt!r}: {why}: {h['text']!r}")
    assert not failures, "; ".join(failures)


def test_unconstrained_answers_validate_far_less_often():
    n = len(schemas.CASES) * 3
    if any(len(v) < n for v in VALID.values()):
        pytest.skip("needs every decode of the tests above in this run")
    held, free = (sum(VALID[side].values()) for side in schemas.SIDES)
    print(f"\nvalid: constrained {held}/{n}, unconstrained {free}/{n}")
    assert held == n and free < 0.5 * n
