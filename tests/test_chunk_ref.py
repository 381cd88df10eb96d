"""The reference scorer (`ref`, the predecessor's chunk-eval) rule by rule, against hand counts."""

from __future__ import annotations

import json

import pytest

from mlxlab.tasks.chunk import metrics, ref, scoring

U = [
    "aaaaaaaa-0000-4000-8000-000000000000",
    "bbbbbbbb-1111-4000-8000-000000000000",
    "cccccccc-2222-4000-8000-000000000000",
    "dddddddd-3333-4000-8000-000000000000",
    "eeeeeeee-4444-4000-8000-000000000000",
]
CONV = "99999999-9999-4999-8999-999999999999"


def answer(*spans, labels=None):
    labels = labels or [f"Topic number {k}" for k in range(len(spans))]
    return json.dumps(
        {
            "chunks": [
                {"start_message_uuid": s, "end_message_uuid": e, "label": lab}
                for (s, e), lab in zip(spans, labels, strict=True)
            ]
        }
    )


def total(schema, anchors, labels, nonempty=1.0):
    return 100 * (0.30 * schema + 0.35 * anchors + 0.15 * labels + 0.20 * nonempty)


def test_a_clean_cover_scores_100():
    r = ref.score_ref(answer((U[0], U[1]), (U[2], U[4])), U)
    assert (r.ref, r.repairs) == (100.0, 0)


@pytest.mark.parametrize(
    "spans",
    [
        [(U[0], U[1]), (U[3], U[4])],  # interior gap (message 2 in no chunk)
        [(U[0], U[2]), (U[2], U[4])],  # overlap
        [(U[1], U[2]), (U[3], U[4])],  # leading gap
    ],
)
def test_interior_gaps_and_overlaps_cost_nothing(spans):
    r = ref.score_ref(answer(*spans), U)
    assert (r.ref, r.repairs) == (100.0, 0)
    # the strict scorer zeroes the anchors for the same answer
    assert scoring.score_case(answer(*spans), U, []).anchors == 0.0


def test_a_trailing_gap_extends_the_latest_ending_chunk():
    # chunks end at messages 3 and 1: the one ending at 3 is extended to 4, one repair of 2 x 2
    r = ref.score_ref(answer((U[2], U[3]), (U[0], U[1])), U)
    assert r.repairs == 1 and r.ref == pytest.approx(total(1, 0.75, 1))


def test_the_conversation_uuid_snaps_to_the_first_or_last_message():
    r = ref.score_ref(answer((CONV, U[1]), (U[2], CONV)), U, conversation_uuid=CONV)
    assert r.repairs == 2 and r.ref == pytest.approx(total(1, 0.5, 1))
    # without knowing the conversation's uuid it resolves nothing: the case fails validation
    r = ref.score_ref(answer((CONV, U[1]), (U[2], U[4])), U)
    assert r.anchors == 0.0 and r.ref == pytest.approx(total(1, 0, 1))


def test_a_unique_long_enough_prefix_resolves_with_one_repair():
    near = U[2][:12] + "ffff"  # 12 characters in common with message 2, 0-1 with the rest
    r = ref.score_ref(answer((U[0], U[1]), (near, U[4])), U)
    assert r.repairs == 1 and r.ref == pytest.approx(total(1, 0.75, 1))
    short = U[2][:7] + "z"  # 7 < 8 characters: unresolvable
    assert ref.score_ref(answer((U[0], U[1]), (short, U[4])), U).anchors == 0.0


def test_a_prefix_tied_with_the_second_best_is_unresolvable():
    twins = ["abcdefgh-1-x", "abcdefgh-2-y", U[2]]
    r = ref.score_ref(answer(("abcdefgh-", twins[2])), twins)
    assert r.anchors == 0.0 and "unresolvable" in r.notes[-1]


def test_an_unknown_uuid_fails_validation():
    r = ref.score_ref(answer((U[0], "not-a-uuid"), (U[2], U[4])), U)
    assert (r.anchors, r.schema, r.labels) == (0.0, 1.0, 1.0)
    assert r.ref == pytest.approx(65.0)


def test_an_inverted_range_is_swapped_with_one_repair():
    r = ref.score_ref(answer((U[1], U[0]), (U[2], U[4])), U)
    assert r.repairs == 1 and r.ref == pytest.approx(total(1, 0.75, 1))


def test_empty_and_missing_chunk_lists():
    assert ref.score_ref(json.dumps({"chunks": []}), U).ref == pytest.approx(80.0)
    for text in ("no json here", "[1, 2]", json.dumps({"chunks": "x"}), json.dumps({"a": []})):
        assert ref.score_ref(text, U).ref == 0.0, text


def test_extraction_order():
    body = answer((U[0], U[4]))
    assert ref.extract_json_ref(f"  {body}\n") == json.loads(body)
    assert ref.extract_json_ref(f"```json\n{body}\n```") == json.loads(body)
    assert ref.extract_json_ref(f"```\n{body}```") == json.loads(body)
    assert ref.extract_json_ref(f"Here it is: {body} -- done") == json.loads(body)
    assert ref.extract_json_ref("{ not json }") is None


def test_labels_and_schema_shares():
    labels = ["Chat", "General Discussion", " q&a ", "Decorators in Python", " ".join(["w"] * 13)]
    spans = [(U[k], U[k]) for k in range(5)]
    r = ref.score_ref(answer(*spans, labels=labels), U)
    assert r.labels == pytest.approx(1 / 5) and r.anchors == 1.0
    bad = json.loads(answer((U[0], U[1]), (U[2], U[4])))
    bad["chunks"][1]["label"] = 7
    r = ref.score_ref(json.dumps(bad), U)
    assert r.schema == 0.5 and r.labels == 0.5 and r.anchors == 1.0
    bad["chunks"][1] = "a string, not a chunk"
    r = ref.score_ref(json.dumps(bad), U)
    assert r.schema == 0.5 and r.anchors == 0.0


def test_each_case_and_summary_carry_ref():
    gold = json.loads(answer((U[0], U[1]), (U[2], U[4])))["chunks"]
    s = scoring.score_case(answer((U[0], U[1]), (U[3], U[4])), U, gold)
    # strict finds the gap unrepairable, so it scores no boundaries against the gold either
    assert s.ref == 100.0 and s.wellformed < 100.0 and s.boundary_f1 == 0.0
    assert scoring.score_case(json.dumps({"chunks": gold}), U, gold).ref == 100.0
    summary = metrics.summarize([s.to_dict(), scoring.score_case("nothing", U, []).to_dict()])
    assert summary["ref"] == 50.0
    assert "| ref | strict |" in metrics.table({"tuned": summary})
    # results written before the reference scorer: no ref, shown as "-"
    old = [{k: v for k, v in s.to_dict().items() if k != "ref"}]
    assert "ref" not in metrics.summarize(old) and "| tuned | 1 | - |" in metrics.table(
        {"tuned": metrics.summarize(old)}
    )
