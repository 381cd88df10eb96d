"""schemathesis against the server's own OpenAPI schema (/openapi.json) on tiny-gemma3: every
route, schema-valid and schema-breaking requests, a bounded number of each; no 5xx, no answer
that breaks the schema's own description of it (status codes, content types, error bodies),
schema-breaking requests refused with a 4xx, and the server still serving afterwards."""

from __future__ import annotations

import re

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.hypothesis.builder import add_examples

from tests.helpers.serve import make_client

EXAMPLES = 25  # per operation and mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    tiny_dir("gemma3")
    # schemathesis' ASGI client names the host "testserver"; max_tokens stays small by default,
    # and generated max_tokens are bounded by the 2 GB budget's context ceiling.
    client, gateway = make_client(
        allowed_hosts=["testserver"],
        max_tokens=8,
        adapter_root=str(tmp_path_factory.mktemp("adapters")),
        # the audio and embeddings routes get real models behind them too
        stt_model="tiny-whisper",
        embeddings_model="tiny-bert",
    )
    yield client
    gateway.stop()


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_asgi("/openapi.json", served.app)


# The operations whose published schema states every rule the server checks on a field by itself
# (issue 56: it was looser on these, and schemathesis warned that they "mostly rejected generated
# data"). A request their schema allows may still be refused, but only for what a schema cannot
# say: the model (its vocabulary, context, vectors, chat template), the server's state (mounted
# adapters, files under the adapter root), a rule across fields or messages, or the content of a
# string (audio, base64, JSON, a JSON schema the grammar engine compiles). Those reasons:
AGREED = {
    "POST /v1/adapters",
    "POST /v1/audio/transcriptions",
    "POST /v1/audio/translations",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/embeddings",
}
CANNOT_SAY = re.compile(
    "|".join(
        [
            # the model or the server's state
            r"token id",
            r"not a token id of this model",
            r"this model's vectors have",
            r"not trained for shortened vectors",
            r"exceeds the max safe context",
            r"chat template",
            r"is not mounted",
            r"^vision_not_supported:",  # images, to a text-only model
            r"adapter .*: missing|adapter_config",
            # across fields or messages
            r"a 'tool' message must follow",
            r"is not among the tool_calls",
            r"input_audio goes in user messages",
            r"needs response_format=verbose_json",
            r"a forced tool call needs|no offered tool is named",
            r"cannot start inside the model's reasoning",
            r"answers in one request",  # prompts x n
            # the content of a string
            r"arguments are not JSON",
            r"is not valid base64",
            r"is not audio FFmpeg can read|has no audio stream|no audio",
            r"^invalid_schema:",  # a JSON schema the grammar engine cannot compile
            r"^invalid_image:",  # a URL that is not an image
        ]
    )
)
# 4xx answers that say nothing about the data (schemathesis counts them apart too)
NOT_ABOUT_DATA = {401, 403, 404, 409, 429}


def refusal(response) -> str | None:
    """The error code and message of a 4xx that refuses the data, else None."""
    if not 400 <= response.status_code < 500 or response.status_code in NOT_ABOUT_DATA:
        return None
    error = response.json().get("error") or {}
    return f"{error.get('code')}: {error.get('message')}"


def exercise(op, mode, loose: dict, answered: set) -> None:
    """A hypothesis run of EXAMPLES cases of `op` (and, in the positive mode, the schema's own
    example requests first), derandomized, through the app; what the AGREED operations refuse
    and whether they answered recorded in `loose` and `answered`."""
    label = f"{op.method.upper()} {op.path}"
    agreed = mode is GenerationMode.POSITIVE and label in AGREED

    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )
    def run(case):
        response = case.call()
        if agreed:
            why = refusal(response)
            if why is None:
                answered.add(label)
            elif not CANNOT_SAY.search(why):
                loose.setdefault(label, set()).add(why[:160])
        case.validate_response(response, checks=CHECKS)

    if mode is GenerationMode.POSITIVE:
        run = add_examples(run, op, fill_missing=False)
    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_route_survives_generated_requests(api_schema, mode):
    """Each operation in turn (schemathesis' pytest plugin does not run on pytest 9): a
    hypothesis run of EXAMPLES cases, derandomized, through the app; failures name the route.
    In the positive mode, the AGREED operations' refusals are CANNOT_SAY's reasons only, and
    each of them answers some generated request (2xx, or 404 for a resource it names)."""
    operations = [op.ok() for op in api_schema.get_all_operations()]
    assert len(operations) >= 16  # every route is in the schema
    failures, tried = [], 0
    loose: dict[str, set] = {}  # AGREED operation -> refusals a schema could have said
    answered: set[str] = set()
    for op in operations:
        try:
            exercise(op, mode, loose, answered)
            tried += 1
        except hypothesis.errors.Unsatisfiable:
            # No schema-breaking request exists (no body, no typed parameter: GET /health,
            # a string path parameter): nothing to try in this mode.
            assert mode is GenerationMode.NEGATIVE, op.path
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"{op.method.upper()} {op.path}: {str(e)[:800]}")
    assert not failures, "\n\n".join(failures)
    assert not loose, f"schema-valid requests refused for a reason the schema could state: {loose}"
    if mode is GenerationMode.POSITIVE:
        assert answered == AGREED, f"every generated request refused: {AGREED - answered}"
    # Every route with a body (or typed parameters) was tried in both modes.
    assert tried >= (16 if mode is GenerationMode.POSITIVE else 6), tried


def test_the_server_still_serves_after_the_fuzzing(served):
    r = served.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and served.get("/health").json()["status"] == "ok"


# Found by the fuzzing above ------------------------------------------------------------------


def test_top_k_above_the_vocabulary_means_no_top_k(served):
    """It was a 500 (mlx-lm refuses top_k >= vocab) that also broke every later request."""
    r = served.post("/v1/completions", json={"prompt": "abc", "top_k": 3982, "max_tokens": 4})
    assert r.status_code == 200
    again = served.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
    assert again.status_code == 200


def test_a_sampler_that_raised_mid_trace_no_longer_breaks_the_random_state():
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxlab.serve.engine.rows import heal_random_state

    logits = mx.zeros((1, 16))
    try:
        with pytest.raises(ValueError):
            make_sampler(temp=1.0, top_k=99)(logits)  # compiled; raises while tracing
        with pytest.raises(RuntimeError):
            mx.eval(mx.random.state)  # what every later request hit
        assert heal_random_state() is True
    finally:
        heal_random_state()  # the state is the process's: never leave it broken for others
    assert make_sampler(temp=1.0)(logits).shape == (1,)
    assert heal_random_state() is False
