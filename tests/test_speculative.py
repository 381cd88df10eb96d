"""Speculative decoding (mlxlab/decode/speculative.py): prompt lookup, the KV rollback past a
sliding window's wrap, greedy tokens equal to the plain decode's, the sampled distribution
unchanged (chi-square), seeded runs repeatable, grammar fast-forward and draft checks, draft
models, the batched lane's draft length (speculative_batch.py) and the settings' errors."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import pytest

from mlxlab.decode import speculative as spec
from mlxlab.decode import speculative_batch as sb
from mlxlab.decode.batch import Row
from mlxlab.decode.prompt_cache import PromptCache, prefill
from mlxlab.decode.serial import run_serial
from mlxlab.decode.settings import DecodeSettings
from mlxlab.errors import UserError


@pytest.fixture(scope="module")
def gemma(tiny_dir):
    """Tiny Gemma 3: sliding layers over 16 tokens (rotating caches wrap within a test)."""
    from mlx_lm.utils import load

    return load(str(tiny_dir("gemma3")))


@pytest.fixture(scope="module")
def llama(tiny_dir):
    from mlx_lm.utils import load

    return load(str(tiny_dir("llama")))


def _prompt(seed: int, lo: int = 10, hi: int = 40) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))]
    return base + base[: rng.randint(3, 10)]


def _serial(model, prompt, n, settings=None, **kw):
    out = {}
    row = Row(list(prompt), n, lambda t, lp: None, lambda f, t: out.update(f=f, t=list(t)), **kw)
    run_serial(model, row, settings or DecodeSettings())
    return out["t"], out["f"], row


class Oracle(spec.Drafter):
    """Drafts that are the plain decode's next tokens, some of them changed: every acceptance
    count from none to all occurs, so every rollback path runs (the verify and the rollback are
    the real ones)."""

    def __init__(self, truth, prompt_len, limit, seed, wrong=0.5):
        super().__init__(limit)
        self.truth, self.prompt_len = truth, prompt_len
        self.rng, self.wrong = random.Random(seed), wrong

    def draft(self, ahead, room, seq):
        at = len(seq()) + len(ahead) - self.prompt_len
        k = min(self.rng.randint(0, self.limit), room)
        d = list(self.truth[at : at + k])
        if d and self.rng.random() < self.wrong:
            j = self.rng.randrange(len(d))
            d[j] = (d[j] + 1) % 200
        return d, 0


def _run(model, prompt, n, drafter, processors=(), sampler=None):
    from mlx_lm.models.cache import make_prompt_cache

    row = Row(list(prompt), n, lambda t, lp: None, lambda f, t: None, sampler=sampler)
    row.processors = list(processors)
    kv = make_prompt_cache(model)
    prefill(model, kv, prompt[:-1], 512)
    finish = spec.run(model, row, kv, drafter, prompt[-1])
    return row.tokens, finish, kv


# --- prompt lookup -----------------------------------------------------------------------------


def test_lookup_drafts_what_followed_the_latest_earlier_match_longest_first():
    look = spec.Lookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # the suffix (1, 2, 3) occurred at the start: 4, 5, 9 followed it
    assert look.draft(3) == [4, 5, 9]
    # (2, 3) alone would match its latest occurrence (7, 8) but the longer match wins
    look.extend([6])
    assert look.draft(2) == []  # (..., 3, 6) occurred nowhere before
    assert look.draft(2, after=[2, 3]) == [6]  # the latest (2, 3) is the one just written
    assert spec.Lookup([5, 5]).draft(4) == []  # one token never matches (MIN_NGRAM = 2)
    assert spec.Lookup([5, 5, 5]).draft(4) == [5]  # never its own suffix: the earlier one


# --- rollback ----------------------------------------------------------------------------------


def _kv(n, seed):
    mx.random.seed(seed)
    return mx.random.normal((1, 1, n, 4)), mx.random.normal((1, 1, n, 4))


@pytest.mark.parametrize("before", [3, 7, 20, 41])
@pytest.mark.parametrize("written,kept", [(5, 1), (5, 3), (4, 4), (2, 1)])
def test_a_rotating_cache_rolls_back_past_its_wrap(before, written, kept):
    """A window of 8: after `before` tokens (wrapped or not), a verify writes `written` and keeps
    `kept`; then one plain step. The visible keys equal a cache that only ever saw the kept
    ones (and mlx-lm's own trim does not: it leaves the dropped tokens in a wrapped buffer)."""
    from mlx_lm.models.cache import RotatingKVCache

    k, v = _kv(before + written + 1, seed=before)

    def fill(c, upto):  # token by token, as plain decode steps
        for i in range(upto):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])

    ours, ref = RotatingKVCache(8), RotatingKVCache(8)
    fill(ours, before)
    fill(ref, before)
    ours.update_and_fetch(k[:, :, before : before + written], v[:, :, before : before + written])
    spec.rollback([ours], written - kept)
    ref.update_and_fetch(k[:, :, before : before + kept], v[:, :, before : before + kept])
    assert ours.offset == ref.offset == before + kept
    nxt = before + written  # a different token than the ones rolled back
    got = ours.update_and_fetch(k[:, :, nxt : nxt + 1], v[:, :, nxt : nxt + 1])[0]
    want = ref.update_and_fetch(k[:, :, nxt : nxt + 1], v[:, :, nxt : nxt + 1])[0]

    def window(keys, c):  # the keys a query at the end sees (order aside), as rows
        return sorted(map(tuple, keys[0, 0, -min(c.offset, 8) :].tolist()))

    assert window(got, ours) == window(want, ref)


def test_rollback_refuses_what_it_cannot_take_back():
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    c = RotatingKVCache(4)
    k, v = _kv(9, 0)
    for i in range(9):  # wrapped by single-token updates: nothing to cut
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    with pytest.raises(ValueError, match="multi-token"):
        spec.rollback([c], 1)
    with pytest.raises(ValueError, match="ArraysCache"):
        spec.rollback([ArraysCache(1)], 1)


# --- the serial path ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_verified_greedy_tokens_and_the_cache_are_the_plain_decodes(family, gemma, llama):
    """Drafts right and wrong at every position, past the sliding window's wrap (16): the tokens
    are the plain decode's and the cache ends holding the prompt and exactly those tokens."""
    model, _ = gemma if family == "gemma" else llama
    for seed in range(4):
        prompt = _prompt(seed)
        plain, _, _ = _serial(model, prompt, 40)
        drafter = Oracle(plain, len(prompt), limit=6, seed=seed)
        tokens, finish, kv = _run(model, prompt, 40, drafter)
        assert (tokens, finish) == (plain, "length")
        assert all(c.offset == len(prompt) + 40 for c in kv)
        c = drafter.counts
        assert c.drafted > c.accepted > 0 and c.steps > 0


def test_speculative_serial_stores_the_plain_decodes_prompt_cache_entry(gemma):
    model, _ = gemma
    prompt = _prompt(7, 30, 40)
    stores = {}
    for mode in ("off", "prompt_lookup"):
        cache = PromptCache(1 << 26)
        row = Row(list(prompt), 30, lambda t, lp: None, lambda f, t: None, namespace="n")
        run_serial(model, row, DecodeSettings(speculative=mode), cache)
        kv, n = cache.fetch("n", prompt + row.tokens + [0])
        stores[mode] = (row.tokens, n, [c.offset for c in kv], [c.keys for c in kv])
    (t0, n0, o0, k0), (t1, n1, o1, k1) = stores["off"], stores["prompt_lookup"]
    assert t0 == t1 and n0 == n1 == len(prompt) + 30 and o0 == o1
    for a, b in zip(k0, k1, strict=True):  # the same positions, values within float rounding
        a, b = a[..., : min(a.shape[2], b.shape[2]), :], b[..., : min(a.shape[2], b.shape[2]), :]
        assert a.shape == b.shape


def test_a_row_finishing_inside_the_accepted_drafts_stops_there(gemma):
    model, tok = gemma
    prompt = _prompt(3)
    plain, _, _ = _serial(model, prompt, 30)
    stop_at = plain[12]
    want = plain[: plain.index(stop_at) + 1]

    def feed(token, lp):
        return "stop" if token == stop_at else None

    from mlx_lm.models.cache import make_prompt_cache

    row = Row(list(prompt), 30, feed, lambda f, t: None)
    kv = make_prompt_cache(model)
    prefill(model, kv, prompt[:-1], 512)
    drafter = Oracle(plain, len(prompt), limit=8, seed=1, wrong=0.0)
    assert spec.run(model, row, kv, drafter, prompt[-1]) == "stop"
    assert row.tokens == want
    assert all(c.offset == len(prompt) + len(want) for c in kv)


def test_prompt_lookup_on_the_serial_path_matches_plain_greedy(gemma):
    model, _ = gemma
    settings = DecodeSettings(speculative="prompt_lookup", draft_tokens=5)
    for seed in range(3):
        prompt = _prompt(seed)
        plain, f0, _ = _serial(model, prompt, 30)
        ours, f1, row = _serial(model, prompt, 30, settings)
        assert (ours, f1) == (plain, f0)
        assert row.speculation is not None


# --- sampling ----------------------------------------------------------------------------------


def _chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the categories with expected count >= 5 (the rest lumped)."""
    stat, rest_o, rest_e, df = 0.0, 0, 0.0, -1
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            rest_o, rest_e = rest_o + o, rest_e + e
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / max(rest_e, 1e-9)
        df += 1
    return stat, df


CHI2_999 = {4: 18.47, 5: 20.52, 6: 22.46, 8: 26.12, 9: 27.88, 10: 29.59, 12: 32.91, 14: 36.12,
            15: 37.70, 16: 39.25, 18: 42.31, 20: 45.31, 24: 51.18}  # fmt: skip


def _crit(df: int) -> float:
    return CHI2_999.get(df) or 2 * df + 10


class Fixed(spec.Drafter):
    """The same two drafts every step (point masses): one likely, one not."""

    def __init__(self, drafts):
        super().__init__(len(drafts))
        self.drafts = drafts

    def draft(self, ahead, room, seq):
        return list(self.drafts[:room]) if not ahead else [], 0


def test_sampled_tokens_keep_the_models_distribution(llama):
    """temperature 1, top_k 5: the first token and the two-token sequences of 1,500 speculative
    runs (drafts: the second most likely first token, then the most likely after it) against
    the model's own probabilities, chi-square at 0.1%. Accepting drafts without the rule (a
    draft written whenever it is among the allowed tokens) fails the same test."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model, _ = llama
    prompt = _prompt(11)
    sampler = make_sampler(temp=1.0, top_k=5)

    def dist(tokens):
        c = make_prompt_cache(model)
        logits = model(mx.array([tokens]), cache=c)[0, -1]
        top = mx.argsort(-logits)[:5].tolist()
        p = mx.softmax(logits[mx.array(top)]).tolist()
        return dict(zip(top, p, strict=True))

    p1 = dist(prompt)
    p2 = {(a, b): pa * pb for a, pa in p1.items() for b, pb in dist(prompt + [a]).items()}
    ranked = sorted(p1, key=p1.get, reverse=True)
    d1 = ranked[1]
    d2 = max(dist(prompt + [d1]).items(), key=lambda kv: kv[1])[0]

    kv0 = make_prompt_cache(model)
    prefill(model, kv0, prompt[:-1], 512)
    mx.random.seed(0)
    n = 1500
    firsts, pairs = {}, {}
    for _ in range(n):
        row = Row(list(prompt), 2, lambda t, lp: None, lambda f, t: None, sampler=sampler)
        spec.run(model, row, kv0, Fixed([d1, d2]), prompt[-1])
        spec.rollback(kv0, 3)  # back to the prompt but its last token (plain KV caches trim)
        a, b = row.tokens
        firsts[a] = firsts.get(a, 0) + 1
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    s1, df1 = _chi2(firsts, p1, n)
    s2, df2 = _chi2(pairs, p2, n)
    assert s1 < _crit(df1), (s1, df1)
    assert s2 < _crit(df2), (s2, df2)
    # the negative control: always writing d1 when it is allowed shifts the first token to it
    biased = dict(firsts)
    biased[d1] = biased.get(d1, 0) + biased.pop(ranked[0], 0)
    assert _chi2(biased, p1, n)[0] > _crit(df1)


def test_seeded_speculative_sampling_repeats_itself(gemma):
    from mlx_lm.sample_utils import make_sampler

    model, _ = gemma
    prompt = _prompt(5)
    settings = DecodeSettings(speculative="prompt_lookup")
    runs = []
    for _ in range(2):
        mx.random.seed(42)
        runs.append(_serial(model, prompt, 30, settings, sampler=make_sampler(temp=0.8))[0])
    assert runs[0] == runs[1]
    mx.random.seed(43)
    assert _serial(model, prompt, 30, settings, sampler=make_sampler(temp=0.8))[0] != runs[0]


# --- settings ----------------------------------------------------------------------------------


def test_bad_settings_are_one_line_errors():
    with pytest.raises(
        UserError, match="speculative must be one of off, prompt_lookup, draft_model"
    ):
        DecodeSettings(speculative="medusa")
    with pytest.raises(UserError, match="draft_tokens"):
        DecodeSettings(speculative="prompt_lookup", draft_tokens=0)
    with pytest.raises(UserError, match="needs draft_model"):
        spec.check_mode("draft_model", None)
    with pytest.raises(UserError, match="only with speculative=draft_model"):
        spec.check_mode("prompt_lookup", "gemma3-270m")


# --- the batched path --------------------------------------------------------------------------


def _batch(model, tok, prompts, settings, draft=None, cache=None, selection=None, specs=None):
    from mlxlab.decode.batch import BatchDecoder

    out: dict = {}
    d = BatchDecoder(
        model, set(tok.eos_token_ids), settings, cache, selection=selection, draft_model=draft
    )
    for i, p in enumerate(prompts):
        d.add(
            Row(
                list(p),
                24 + 3 * i,  # rows finish at different steps: others join and leave
                lambda t, lp: None,
                lambda f, t, i=i: out.__setitem__(i, (f, list(t))),
                adapter=specs[i] if specs else (),
                namespace="n" if cache is not None else None,
            )
        )
    d.run()
    return [out[i] for i in range(len(prompts))], d.speculation_counts()


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_batched_rows_accept_different_counts_and_decode_as_plain(
    family, gemma, llama, monkeypatch
):
    """Six rows, four at a time, past the sliding window's wrap: a draft made of the model's
    first layers (a real draft model: rows accept different numbers of its tokens each step),
    the whole model as its own draft (every draft accepted) and prompt lookup all give the
    plain batch's tokens. The step cost is flat here (every row drafts its most), so the
    half-model's poor drafts keep being verified instead of being priced out."""
    monkeypatch.setattr(sb, "step_cost", lambda rows, positions: 1.0)
    model, tok = gemma if family == "gemma" else llama
    layers = len(model.model.layers)
    # lengths far apart: short rows sit behind left padding in rotated sliding-window caches
    spans = [(3, 5), (40, 45), (10, 12), (80, 90), (2, 3), (50, 60)]
    prompts = [_prompt(s, lo, hi) for s, (lo, hi) in enumerate(spans)]
    plain, _ = _batch(model, tok, prompts, DecodeSettings(batch=4))
    partial = spec.self_draft(model, layers // 2)
    whole = spec.self_draft(model, layers)
    for mode, draft in (("draft_model", partial), ("draft_model", whole), ("prompt_lookup", None)):
        settings = DecodeSettings(batch=4, speculative=mode, draft_tokens=5)
        got, counts = _batch(model, tok, prompts, settings, draft)
        assert got == plain, (mode, draft is whole)
        if draft is whole:
            assert counts.accepted == counts.drafted > 0
        elif draft is partial:
            assert 0 < counts.accepted < counts.drafted


def test_batched_speculation_stores_what_plain_decoding_stores(gemma):
    model, tok = gemma
    prompts = [_prompt(s, 20, 30) for s in range(3)]
    entries = {}
    for mode in ("off", "draft_model"):
        cache = PromptCache(1 << 26)
        settings = DecodeSettings(batch=3, speculative=mode, draft_tokens=4)
        draft = spec.self_draft(model, 3) if mode != "off" else None
        got, _ = _batch(model, tok, prompts, settings, draft, cache=cache)
        found = []
        for p, (_, tokens) in zip(prompts, got, strict=True):
            kv, n = cache.fetch("n", p + tokens + [0])
            found.append((tokens, n, [c.offset for c in kv], [c.keys.shape for c in kv]))
        entries[mode] = found
    assert entries["off"] == entries["draft_model"]
    assert all(
        n == len(p) + len(t) for p, (t, n, _, _) in zip(prompts, entries["off"], strict=True)
    )


def test_each_row_is_verified_under_its_own_adapter(tiny_dir, tmp_path):
    from mlx_lm.utils import load

    from mlxlab.serve.engine.adapters import Adapters
    from tests.helpers.serve import make_adapter

    model_dir = tiny_dir("llama")
    model, tok = load(str(model_dir))
    adapters = Adapters(model, tmp_path)
    for name, seed in (("a", 1), ("b", 2)):
        adapters.mount(name, make_adapter(model_dir, tmp_path / name, seed))
    prompts = [_prompt(s) for s in (20, 21)]
    # the whole model as its own draft, sharing its adapters: drafted under each row's own
    # adapter, every draft is accepted
    draft = spec.self_draft(model, len(model.model.layers))

    def run(specs, mode):
        settings = DecodeSettings(batch=2, speculative=mode, draft_tokens=4)
        got, counts = _batch(
            model,
            tok,
            prompts,
            settings,
            draft if mode == "draft_model" else None,
            selection=adapters.selection,
            specs=specs,
        )
        return [t for _, t in got], counts

    mixed, counts = run([("a",), ("b",)], "draft_model")
    assert counts.accepted == counts.drafted > 0
    assert mixed == run([("a",), ("b",)], "off")[0]
    assert mixed[0] == run([("a",), ("a",)], "off")[0][0]
    assert mixed[1] == run([("b",), ("b",)], "off")[0][1]
    assert run([("a",), ("b",)], "prompt_lookup")[0] == mixed


# --- grammars ----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "size": {"type": "integer"},
    },
    "required": ["name", "tags", "size"],
}


def _width(model, tok):
    return max(model.model.embed_tokens.weight.shape[0], len(tok._tokenizer))


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("watch", [False, True])
def test_constrained_rows_fast_forward_and_decode_as_plain(gemma, batch_size, watch):
    """Under a JSON schema the grammar forces keys and punctuation: those are drafted first
    (llguidance's fast-forward) and cost no step of their own; drafts the grammar refuses are
    cut before they are verified. Texts, and where a watching constraint saw the grammar refuse
    the model's top token, equal the plain decode's."""
    from mlxlab import grammar
    from mlxlab.decode.offline import complete

    model, tok = gemma
    width = _width(model, tok)
    g = grammar.json_schema(SCHEMA)
    prompts = [_prompt(s) for s in range(3)]
    made: dict = {}

    def run(mode):
        def processors(i):
            made[(mode, i)] = grammar.constrain(g, tok, width, watch=watch)
            return [made[(mode, i)]]

        counts = spec.Counts()
        texts = complete(
            model, tok, prompts, 40, batch_size, None, processors, speculative=mode, counts=counts
        )
        return texts, counts

    plain, _ = run("off")
    ours, counts = run("prompt_lookup")
    assert ours == plain
    assert counts.forced > 0 and counts.accepted >= counts.forced
    if watch:
        for i in range(len(prompts)):
            assert made[("prompt_lookup", i)].refused() == made[("off", i)].refused()


def test_rows_under_a_grammar_fast_forward_whatever_their_rates(gemma, monkeypatch):
    """Three rows under a JSON schema whose drafter is never right (rate 0): the tokens the
    grammar forces are certain, so they are still drafted and verified, and the texts are the
    plain decode's."""
    from mlxlab import grammar
    from mlxlab.decode.offline import complete

    monkeypatch.setattr(spec.Drafter, "rate", property(lambda self: 0.0))
    model, tok = gemma
    g = grammar.json_schema(SCHEMA)
    prompts = [_prompt(s) for s in range(3)]

    def run(mode):
        counts = spec.Counts()
        procs = lambda i: [grammar.constrain(g, tok, _width(model, tok))]  # noqa: E731
        texts = complete(model, tok, prompts, 40, 3, None, procs, speculative=mode, counts=counts)
        return texts, counts

    ours, counts = run("prompt_lookup")
    assert counts.forced > 0 and counts.accepted >= counts.forced
    assert ours == run("off")[0]


def test_a_constraint_drafts_its_forced_tokens_then_what_it_allows(gemma):
    from mlxlab import grammar

    model, tok = gemma
    c = grammar.constrain(grammar.json_schema(SCHEMA), tok, _width(model, tok))
    want = tok.encode('{"name":', add_special_tokens=False)
    ok = tok.encode(' "ab"', add_special_tokens=False)
    bad = tok.encode("}", add_special_tokens=False)  # "tags" and "size" are required
    drafts, forced = c.draft([], 12, lambda forced, n: ok + bad + ok)
    assert drafts[:forced] == want  # the key is forced
    assert drafts == want + ok  # the drafter's tokens, cut before the refused "}"
    assert c.draft([], 12, lambda f, n: []) == (want, len(want))  # the matcher is unchanged
    assert c.allowed_prefix([], want + ok + bad) == len(want + ok)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_chunk_evaluation_decodes_as_plain_with_speculation(
    tiny_dir, tmp_path, batch_size, monkeypatch
):
    """The chunk task's decode (answers that copy message uuids from the prompt), constrained
    and not: every row as without speculation, and the drafted tokens counted. The batched
    lane's step cost is flat here (every row drafts its most: the tiny random model's drafts
    are rejected often enough that the measured costs would price them out, and this checks
    what verifying them does, not the choice of the draft length)."""
    from mlxlab.tasks.chunk import evaluate as ev
    from tests.test_chunk_task import _tiny_chunk_cases

    monkeypatch.setattr(sb, "step_cost", lambda rows, positions: 1.0)

    model, tokenizer, records = _tiny_chunk_cases(tiny_dir, tmp_path, 3)
    for constrained in (False, True):
        plain = ev.evaluate(model, tokenizer, records, 40, batch_size, constrained=constrained)
        counts = spec.Counts()
        ours = ev.evaluate(
            model,
            tokenizer,
            records,
            40,
            batch_size,
            constrained=constrained,
            speculation={"speculative": "prompt_lookup", "counts": counts},
        )
        assert [r["output"] for r in ours] == [r["output"] for r in plain]
        assert counts.drafted > 0
        if constrained:
            assert counts.forced > 0


# --- the real model ----------------------------------------------------------------------------

REAL_TEXTS = [
    "Original paragraph:\n\nThe history of the printing press begins in the fifteenth century, "
    "when Johannes Gutenberg developed a system of movable metal type in the German city of "
    "Mainz. Before his invention, books were copied by hand, a slow and expensive process that "
    "kept them out of reach of most people.\n\nThe same paragraph, copied exactly:\n\n",
    "Chapter One\n\nThe lighthouse keeper had not slept for three nights. The storm",
    'Records: [{"id": "c9f1e4-7b2a", "city": "Lyon"}, {"id": "d03a11-9c4e", "city": "Porto"}]\n'
    "The same records with the key 'city' renamed to 'town':\n",
    "def total_price(items, tax_rate):\n    subtotal = 0.0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n\n"
    "# the same function, renamed to price_with_tax:\n",
]


@pytest.mark.slow
@pytest.mark.real_model
def test_gemma3_270m_speculative_greedy_is_plain_but_for_near_ties(real_model_dir):
    """Greedy gemma3-270m (its bf16 decode weights, the kernel's verify rows) with prompt lookup
    against plain decoding over four texts: the tokens are the same but where the plain step's
    top two logits were within float rounding (at most 1 in 1,000 positions), and lookup
    drafts are accepted."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxlab.models.zoo import load

    model, tok = load(str(real_model_dir))
    positions, differ, accepted = 0, [], 0
    for text in REAL_TEXTS:
        ids = tok.encode(text)
        plain, _, _ = _serial(model, ids, 160)
        settings = DecodeSettings(speculative="prompt_lookup", draft_tokens=8)
        ours, _, row = _serial(model, ids, 160, settings)
        accepted += row.speculation.accepted
        same = next((j for j, (a, b) in enumerate(zip(plain, ours, strict=True)) if a != b), None)
        positions += len(plain) if same is None else same + 1
        if same is not None:
            logits = model(mx.array([ids + plain[:same]]), cache=make_prompt_cache(model))[0, -1]
            top = mx.sort(logits)[-2:].tolist()
            differ.append(abs(top[1] - top[0]) / max(abs(top[1]), 1.0))
    assert accepted > 100
    assert all(gap <= 1e-4 for gap in differ), differ
    assert len(differ) <= max(1, positions // 1000), (differ, positions)


def test_the_draft_length_shrinks_with_the_rows_and_the_acceptance_rate(monkeypatch):
    """k maximizes expected tokens per step cost (the CPU's): one row drafts several at a high
    rate, more rows fewer, a low rate none; past the width where no draft pays, plain steps."""
    monkeypatch.setattr(sb, "_cpu", lambda: True)
    ks = [sb.width([(0.86, 8, 0)] * n) for n in (1, 2, 4, 8, 16)]
    assert ks[0] >= 2 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    assert sb.width([(0.05, 8, 0)]) == 0
    assert sb.width([(0.86, 0, 0)] * 2) == 0  # no drafts, nothing to verify
    # forced tokens are certain: they pay where the drafter's own would not
    assert sb.width([(0.05, 3, 3)]) >= 1
    # a row without drafts does not stop the others' (it pays the padding the model prices)
    assert sb.width([(0.86, 8, 0), (0.86, 0, 0)]) >= 1
    assert sb.expected_tokens(0.5, 2) == 1.75 and sb.expected_tokens(0.0, 3, 2) == 3.0


def test_off_the_cpu_rows_times_positions_stay_within_16(monkeypatch):
    """No GPU costs are measured: a step costs a plain one up to 16 rows x positions, and none
    is verified past it (a draft model's drafts at 32 rows would be 32 x k forward passes)."""
    monkeypatch.setattr(sb, "_cpu", lambda: False)
    assert [sb.width([(0.86, 8, 0)] * n) for n in (1, 2, 4, 8, 16, 32)] == [8, 7, 3, 1, 0, 0]
    assert sb.step_cost(4, 4) == 1.0 and sb.step_cost(4, 5) == math.inf
    assert sb.step_cost(32, 1) == 1.0


def test_the_step_cost_is_monotone_and_interpolates_between_row_counts(monkeypatch):
    from mlxlab.models import fastdecode

    monkeypatch.setattr(sb, "_cpu", lambda: True)
    monkeypatch.setattr(fastdecode, "VERIFY_ROWS", 64)
    table = {
        1: {1: 1.0, 2: 1.2, 3: 1.5},
        2: {1: 1.0, 2: 1.5, 4: 2.3, 5: 2.15},  # 5 positions measured below 4
        4: {1: 1.0, 2: 1.7, 4: 2.7, 5: 3.1},
        8: {1: 1.0, 2: 2.1, 4: 3.5},
    }
    monkeypatch.setattr(sb, "STEP_COST", table)
    assert sb.step_cost(2, 5) == 2.3  # never below fewer positions' cost
    assert sb.step_cost(2, 3) == pytest.approx(1.9)
    for p in range(2, 8):
        costs = [sb.step_cost(2, q) for q in range(1, p + 1)]
        assert costs == sorted(costs)
    # unmeasured row counts lie between the measured ones around them, not at the one below
    assert sb.step_cost(3, 4) == pytest.approx((2.3 + 2.7) / 2)
    assert sb.step_cost(6, 2) == pytest.approx((1.7 + 2.1) / 2)
    assert sb.step_cost(7, 4) == pytest.approx(2.7 + 0.75 * (3.5 - 2.7))
    assert sb.step_cost(12, 2) == sb.step_cost(8, 2) == 2.1  # past the largest: its ratios
    assert sb.step_cost(8, 8) == pytest.approx(3.5 * 8 / 4)  # past the last: in proportion


def test_a_row_acceptance_rate_follows_its_verify_steps():
    d = spec.Drafter(8)
    start = d.rate
    d.settle(4, 4, 0)  # all accepted
    assert d.rate > start
    high = d.rate
    for _ in range(10):
        d.settle(4, 0, 0)  # the first draft rejected
    assert d.rate < 0.2 < high
    low = d.rate
    d.settle(3, 3, 3)  # forced tokens only: the drafter's rate is not theirs
    assert d.rate == low
    d.settle(5, 3, 3)  # forced tokens, then the drafter's first rejected
    assert d.rate < low


def test_a_lone_row_gets_speculation_back_when_its_text_turns_to_copying(monkeypatch):
    """First-draft misses take a lone row's rate below what pays for a draft: its steps are
    plain. Prompt lookup's would-be drafts are checked on those plain steps (free), so when
    the row starts copying its prompt the rate climbs back and drafting resumes; free text the
    lookup has no guess for, or guesses wrong, does not raise it."""
    monkeypatch.setattr(sb, "_cpu", lambda: True)
    rng = random.Random(0)
    passage = [rng.randrange(3, 200) for _ in range(40)]
    d = spec.Drafter(8, lookup=spec.Lookup(passage))
    for _ in range(30):  # first-draft misses until a draft no longer pays (the cost table's say)
        d.settle(4, 0, 0)
        if sb.width([(d.rate, d.k, 0)]) == 0:
            break
    low = d.rate
    assert sb.width([(low, d.k, 0)]) == 0
    d.extend([1000 + i for i in range(6)])  # a verify step's tokens: no shadow check
    assert d.rate == low
    d.extend([2000 + i for i in range(6)], shadow=True)  # new text: the lookup has no guess
    assert d.rate == low
    d.extend(passage[:2] + [3000], shadow=True)  # a guess, wrong
    assert d.rate < low
    d.extend(passage[:12], shadow=True)  # copying: its guesses are right from the fourth token on
    assert d.rate > 0.6 and sb.width([(d.rate, d.k, 0)]) >= 1


def test_a_step_no_draft_can_pay_for_leaves_the_pending_tokens_to_mlx_lm(monkeypatch):
    """Whether drafting can pay is decided before the rows' pending tokens are evaluated, so a
    plain step stays mlx-lm's pipelined one; a row under a grammar (forced tokens are certain)
    makes the decoder look at them."""
    from mlxlab.decode.batch import BatchDecoder

    monkeypatch.setattr(sb, "_cpu", lambda: True)

    class Gen:
        uids, max_tokens, _num_tokens = [0, 1], [50, 50], [3, 3]

        @property
        def _next_tokens(self):
            raise AssertionError("the pending tokens were evaluated")

    d = BatchDecoder.__new__(BatchDecoder)
    d.gen, d.draft_model = Gen(), None
    d.drafters = {u: spec.Drafter(8, lookup=spec.Lookup()) for u in (0, 1)}
    for drafter in d.drafters.values():
        for _ in range(3):
            drafter.settle(4, 0, 0)
    assert d._drafts() is None
    d.drafters[0].grammars = [object()]
    with pytest.raises(AssertionError, match="evaluated"):
        d._drafts()


def test_a_wide_batch_takes_plain_steps_and_decodes_as_plain(gemma, monkeypatch):
    """Ten rows: no draft pays on the CPU's measured costs, so plain steps and no drafts. With a
    flat cost (every row drafts its most) they draft, and still decode as plain."""
    monkeypatch.setattr(sb, "_cpu", lambda: True)
    model, tok = gemma
    prompts = [_prompt(s) for s in range(10)]
    plain, _ = _batch(model, tok, prompts, DecodeSettings(batch=10))
    settings = DecodeSettings(batch=10, speculative="prompt_lookup")
    got, counts = _batch(model, tok, prompts, settings)
    assert got == plain and counts.drafted == 0
    monkeypatch.setattr(sb, "step_cost", lambda rows, positions: 1.0)
    draft = DecodeSettings(batch=10, speculative="draft_model", draft_tokens=4)
    got, counts = _batch(model, tok, prompts, draft, spec.self_draft(model, 6))
    assert got == plain and counts.accepted > 0
