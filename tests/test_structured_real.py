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


@pytest.fixture(scope="module")
def loaded(real_model_dir):
    from mlxlab.models.zoo import load

    return load(str(real_model_dir))


@pytest.fixture(scope="module")
def serial(loaded) -> dict:
    """case name -> its first prompt decoded with `generate_step`, both sides (once a module)."""
    model, tokenizer = loaded
    return {
        case.name: schemas.decode_case(
            model, tokenizer, case, max_tokens=256, prompts=case.prompts[:1]
        )[0]
        for case in schemas.CASES
    }


@pytest.fixture(scope="module")
def batched(loaded) -> dict:
    """side -> the BATCHED pairs decoded together on `BatchGenerator`, in order (once a module).
    Every test takes what it reads from these fixtures, in any order or alone (the rate test
    used to read what the tests before it left in a module global, and skipped without them)."""
    model, tokenizer = loaded
    return {
        side: schemas.decode_batch(
            model, tokenizer, BATCHED, constrained=side == "constrained", max_tokens=256
        )
        for side in schemas.SIDES
    }


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
def test_generate_step_answer_ends_and_validates(serial, case):
    row = serial[case.name]
    why = _why_not(case, row["constrained"])
    assert why is None, f"{case.name}, {row['prompt']!r}: {why}: {row['constrained']['text']!r}"


def test_batched_answers_end_and_validate(batched):
    failures = []
    for (case, prompt), h in zip(BATCHED, batched["constrained"], strict=True):
        if why := _why_not(case, h):
            failures.append(f"{case.name}, {prompt!r}: {why}: {h['text']!r}")
    assert not failures, "; ".join(failures)


def test_unconstrained_answers_validate_far_less_often(serial, batched):
    n = len(schemas.CASES) * 3
    valid = {side: 0 for side in schemas.SIDES}
    for case in schemas.CASES:
        for side in schemas.SIDES:
            valid[side] += schemas.valid(serial[case.name][side]["text"], case.schema)
    for side in schemas.SIDES:
        for (case, _), out in zip(BATCHED, batched[side], strict=True):
            valid[side] += schemas.valid(out["text"], case.schema)
    held, free = valid["constrained"], valid["unconstrained"]
    print(f"\nvalid: constrained {held}/{n}, unconstrained {free}/{n}")
    assert held == n and free < 0.5 * n
