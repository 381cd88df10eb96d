"""schemathesis against the server's own OpenAPI schema (/openapi.json) on tiny-gemma3: every
route, schema-valid and schema-breaking requests, a bounded number of each; no 5xx, no answer
that breaks the schema's own description of it (status codes, content types, error bodies),
schema-breaking requests refused with a 4xx, and the server still serving afterwards."""

from __future__ import annotations

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


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_route_survives_generated_requests(api_schema, mode):
    """Each operation in turn (schemathesis' pytest plugin does not run on pytest 9): a
    hypothesis run of EXAMPLES cases, derandomized, through the app; failures name the route."""
    operations = [op.ok() for op in api_schema.get_all_operations()]
    assert len(operations) >= 16  # every route is in the schema
    failures, tried = [], 0
    for op in operations:

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
            case.validate_response(case.call(), checks=CHECKS)

        try:
            run()
            tried += 1
        except hypothesis.errors.Unsatisfiable:
            # No schema-breaking request exists (no body, no typed parameter: GET /health,
            # a string path parameter): nothing to try in this mode.
            assert mode is GenerationMode.NEGATIVE, op.path
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"{op.method.upper()} {op.path}: {str(e)[:800]}")
    assert not failures, "\n\n".join(failures)
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
