"""GRPO: the four losses against a plain implementation of the published formulas, bit for bit
across the backward modes, and the parts around them (advantages, rewards, prompts, rollouts on
the batched decoder, the loop, resume)."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxlab  # noqa: F401
from mlxlab.config import UserError
from mlxlab.data.prompts import Prompt
from mlxlab.models import tiny
from mlxlab.train import backward as bw
from mlxlab.train import trainer
from mlxlab.train.config import GRPOConfig, TrainConfig
from mlxlab.train.grpo import loop
from mlxlab.train.grpo import losses as L
from tests.helpers.grpo_case import REWARDS, G, case_config, rollout_case

VARIANTS = ("grpo", "dr_grpo", "gspo", "dapo")


# --- advantages, by hand ------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # group [1, 0, 0.5, 1]: mean 0.625, deviations [.375, -.625, -.125, .375], sample std
    # sqrt((.140625 + .390625 + .015625 + .140625) / 3) = 0.478713...
    adv = L.group_advantages(REWARDS, G)
    std = (0.6875 / 3) ** 0.5
    want = [d / (std + 1e-4) for d in (0.375, -0.625, -0.125, 0.375)]
    assert adv[:4].tolist() == pytest.approx(want, rel=1e-6)
    # Dr. GRPO: deviations only; the second group [0, 0, 1, .25]: mean .3125
    assert L.group_advantages(REWARDS, G, "none")[4:].tolist() == pytest.approx(
        [-0.3125, -0.3125, 0.6875, -0.0625], rel=1e-6
    )
    assert L.uniform_groups([1, 1, 0, 1, 2, 2, 2, 2], G).tolist() == [False, True]
    assert L.group_advantages([2, 2, 2, 2], G).tolist() == [0, 0, 0, 0]


# --- the losses on a tiny model ------------------------------------------------------------------


def _rollout(family: str = "llama", seed: int = 0):
    return rollout_case(family, seed)


def _cfg(variant: str, updates: int = 2, beta: float = 0.05, **kw) -> TrainConfig:
    return case_config(variant, updates, beta, **kw)


def _batches(variant: str, family: str = "llama", updates: int = 2, grad_accum: int = 1, **kw):
    """(model, objective, batches): the rollout's update batches, the old log-probs moved off
    the current ones (as after a first update) so that ratios leave the clip range."""
    model, prompts, completions = _rollout(family)
    cfg = _cfg(variant, updates, **kw)
    adv = L.group_advantages(REWARDS, G, cfg.grpo.scale)
    ro = loop.Rollout(prompts, completions, REWARDS, {}, adv, np.ones(len(REWARDS), bool))
    batches = loop.update_batches(ro, cfg, grad_accum, None, model, {})
    if updates > 1:
        rng = np.random.default_rng(1)
        shifted = []
        for b in batches:
            aux = np.array(b.ref)
            aux[:, L.OLD] += rng.normal(0, 0.3, len(aux)).astype(np.float32)
            shifted.append(dataclasses.replace(b, ref=mx.array(aux)))
        batches = shifted
    return model, L.GRPOObjective.from_config(cfg), batches, cfg


def _plain_loss(model, prompts, completions, adv, old, ref, cfg):
    """The published formulas, row by row: each completion run alone through the model's own
    __call__ (full logits, log-softmax, the sampled token's entry), then DeepSeekMath's clipped
    surrogate with the k3 KL, aggregated as each paper does."""
    g = cfg.grpo
    eps, eps_high = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}.get(
        g.loss,
        (0.2, 0.28),  # DAPO's clip-higher
    )
    rows, at = [], 0
    for k, c in enumerate(completions):
        ids = prompts[k // G].ids + c.tokens
        logits = model(mx.array(ids[:-1])[None])[0].astype(mx.float32)
        logp_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = len(prompts[k // G].ids)
        lp = mx.stack([logp_all[p - 1 + t, tok] for t, tok in enumerate(c.tokens)])
        n = len(c.tokens)
        o = mx.stop_gradient(lp) if g.updates == 1 else mx.array(old[at : at + n])
        r = mx.array(ref[at : at + n])
        at += n
        a = float(adv[k])
        if g.loss == "gspo":
            s = mx.exp((lp - o).sum() / n)
            surrogate = -mx.minimum(s * a, mx.clip(s, 1 - eps, 1 + eps_high) * a)
            terms = mx.broadcast_to(surrogate, (n,))
        else:
            ratio = mx.exp(lp - o)
            clipped = mx.clip(ratio, 1 - eps, 1 + eps_high)
            terms = -mx.minimum(ratio * a, clipped * a)
        kl = mx.exp(r - lp) - (r - lp) - 1
        rows.append(terms + g.beta * kl)
    if g.loss in ("grpo", "gspo"):  # 1/G sum_i 1/|o_i| sum_t
        return mx.stack([t.mean() for t in rows]).mean()
    if g.loss == "dr_grpo":  # sum_i sum_t / (G * max_tokens)
        return mx.stack([t.sum() for t in rows]).sum() / (len(rows) * g.max_tokens)
    return mx.stack([t.sum() for t in rows]).sum() / sum(t.shape[0] for t in rows)  # dapo


@pytest.mark.parametrize("updates", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradients_match_the_published_formulas(variant, updates):
    model, objective, (batch,), cfg = _batches(variant, updates=updates)
    model_, prompts, completions = _rollout()
    assert model_ is not model  # a second, identical copy: the plain side's own
    loss, _, grads, metrics = trainer.full_backward(model, objective.loss, compile=False)(
        model, batch
    )
    n = batch.ntoks
    aux = np.array(batch.ref)[:n]
    adv = L.group_advantages(REWARDS, G, cfg.grpo.scale)

    def plain(params):
        model_.update(params)
        return _plain_loss(model_, prompts, completions, adv, aux[:, L.OLD], aux[:, L.REF], cfg)

    want, want_grads = mx.value_and_grad(plain)(model_.trainable_parameters())
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    g, r = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    num = sum(float(((g[k] - r[k]) ** 2).sum()) for k in r) ** 0.5
    den = sum(float((r[k] ** 2).sum()) for k in r) ** 0.5
    assert den > 0 and num / den < 1e-4
    m = dict(zip(L.METRICS, np.array(metrics).tolist(), strict=True))
    assert m["kl"] > 0  # the adapter moves the policy off the reference
    if updates == 1:  # the ratio is 1: nothing clipped
        assert m["ratio"] == 1.0 and m["clip_frac"] == 0.0
    else:  # old log-probs moved by 0.3: some ratios leave the clip range, some stay in it
        assert 0 < m["clip_frac"] < 1 and m["ratio"] != 1.0


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_are_bit_exact_across_backward_modes(family, variant):
    model, objective, (batch,), _ = _batches(variant, family)
    full = trainer.full_backward(model, objective.loss, compile=False)(model, batch)
    runs = [bw.checkpointed_backward(model, objective=objective)(model, batch)]
    for size in (1, 4):
        plan = bw.plan_by_size(len(model.layers), size)
        runs.append(bw.segmented_backward(model, plan, objective=objective)(model, batch))
    for got in runs:
        assert got[0].item() == full[0].item() and got[1].item() == full[1].item()
        assert np.array_equal(np.array(got[3]), np.array(full[3]))
        g, r = dict(tree_flatten(got[2])), dict(tree_flatten(full[2]))
        assert g.keys() == r.keys() and r
        for k in r:
            assert np.array_equal(np.array(g[k]), np.array(r[k])), k
    assert any(float(np.abs(np.array(v)).max()) > 0 for _, v in tree_flatten(full[2]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_accumulated_micro_batches_equal_one_batch(variant):
    """grad_accum splits the completions; each micro-batch weighs its completions (its tokens
    for DAPO), so the step is the one-batch step to float rounding."""
    model, objective, (whole,), _ = _batches(variant, updates=1)
    _, _, parts, _ = _batches(variant, updates=1, grad_accum=3)
    assert len(parts) == 3
    grad_fn = trainer.full_backward(model, objective.loss, compile=False)
    loss, _, grads, _ = grad_fn(model, whole)
    total = sum(b.units for b in parts)
    acc, acc_loss = None, 0.0
    for b in parts:
        part_loss, _, g, _ = grad_fn(model, b)
        w = b.units / total
        acc_loss += part_loss.item() * w
        g = {k: v * w for k, v in tree_flatten(g)}
        acc = g if acc is None else {k: acc[k] + g[k] for k in g}
    assert acc_loss == pytest.approx(loss.item(), rel=1e-5, abs=1e-8)
    want = dict(tree_flatten(grads))
    num = sum(float(((acc[k] - want[k]) ** 2).sum()) for k in want) ** 0.5
    den = sum(float((want[k] ** 2).sum()) for k in want) ** 0.5
    assert den > 0 and num / den < 1e-5


def test_the_first_of_several_updates_has_ratio_one_and_the_second_does_not():
    """mu = 2: the old log-probs are the rollout policy's, computed before the first update, so
    its ratio is exactly 1; after one optimizer step the second update's is not."""
    model, _, _, cfg = _batches("grpo", updates=2)
    model, prompts, completions = _rollout()
    adv = L.group_advantages(REWARDS, G)
    ro = loop.Rollout(prompts, completions, REWARDS, {}, adv, np.ones(len(REWARDS), bool))
    batches = loop.update_batches(ro, cfg, 1, None, model, {})
    objective = L.GRPOObjective.from_config(cfg)
    assert not objective.fixed_old
    optimizer = trainer.make_optimizer(cfg.optim, 2)
    optimizer.init(model.trainable_parameters())
    grad_fn = trainer.full_backward(model, objective.loss, compile=False)
    ratios = []
    for step in (1, 2):
        _, _, metrics = trainer.train_step(model, optimizer, grad_fn, batches, None, step)
        ratios.append(dict(zip(L.METRICS, metrics, strict=True))["ratio"])
    assert ratios[0] == 1.0 and ratios[1] != 1.0


def test_the_reference_is_the_adapter_switched_off():
    model, _, (batch,), _ = _batches("grpo", "gemma3")
    base, _, _ = tiny.build("gemma3", seed=0)
    from mlxlab.train.losses import hidden_states
    from mlxlab.train.objectives import position_ce

    want = -position_ce(base, hidden_states(base, batch.inputs), batch.positions, batch.labels)
    assert np.array_equal(np.array(batch.ref)[:, L.REF], np.array(want))
    policy = L.position_logps(model, batch)
    assert not np.array_equal(np.array(policy), np.array(want))


# --- rewards ----------------------------------------------------------------------------------


def test_json_reward_parses_and_validates_against_the_records_schema():
    from mlxlab.train.grpo.rewards import json_reward

    schema = {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}}}
    texts = [' {"k": "v"} ', '{"k": 1}', '{"k": "v"', "[1, 2]", "[1, 2]"]
    records = [{"schema": schema}] * 4 + [{}]
    assert json_reward(texts, records) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert json_reward.check([{"schema": {"type": "nope"}}]).startswith("record 1: 'schema'")
    assert json_reward.check([{"schema": schema}, {}]) is None


def test_match_reward_exact_list_and_regex():
    from mlxlab.train.grpo.rewards import match_reward

    texts = [" 42\n", "42.0", "b", "x-17", "x-17!"]
    records = [
        {"answer": "42"},
        {"answer": "42"},
        {"answer": ["a", "b"]},
        {"answer_regex": r"x-\d+"},
        {"answer_regex": r"x-\d+"},
    ]
    assert match_reward(texts, records) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert "no 'answer'" in match_reward.check([{"answer": "1"}, {"question": "?"}])
    assert "does not compile" in match_reward.check([{"answer_regex": "("}])


def test_rewards_resolve_weigh_and_refuse_bad_values():
    from mlxlab.train.grpo import rewards as R

    fns = R.resolve(["match", "tests.helpers.grpo_rewards:vowels"], [2.0, 0.5])
    assert [(r.name, r.weight) for r in fns] == [("match", 2.0), ("vowels", 0.5)]
    total, per = R.score(fns, ["aaaa", "ab"], [{"answer": "aaaa"}, {"answer": "x"}])
    assert per == {"match": [1.0, 0.0], "vowels": [1.0, 0.5]}
    assert total == [2.5, 0.25]
    for name, message in (
        ("tests.helpers.grpo_rewards:wrong_length", "returned 1 values for 2"),
        ("tests.helpers.grpo_rewards:not_finite", "not finite"),
        ("tests.helpers.grpo_rewards:raises", "raised RuntimeError: scorer broke"),
    ):
        with pytest.raises(UserError, match=message):
            R.score(R.resolve([name]), ["a", "b"], [{}, {}])
    with pytest.raises(UserError, match="cannot import 'no_such_module'"):
        R.resolve(["no_such_module:f"])
    with pytest.raises(UserError, match="not a function"):
        R.resolve(["tests.helpers.grpo_rewards:nothing"])
    with pytest.raises(UserError, match="prompts: reward needs_letter: record 2 has no 'letter'"):
        R.check(
            R.resolve(["tests.helpers.grpo_rewards:needs_letter"]), [{"letter": 1}, {}], "prompts"
        )


# --- prompts ----------------------------------------------------------------------------------


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_files_render_with_the_template_or_raw(tiny_dir, tmp_path):
    from mlxlab.config import DataConfig
    from mlxlab.data.prompts import load_prompt_split
    from mlxlab.models.zoo import load

    tiny_dir("llama")
    _, tok = load("tiny-llama", "float32")
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "hello", "answer": "x"},
            {"messages": [{"role": "user", "content": "hello"}]},
            {"prompt": "hello", "raw": True},
            {"prompt": "a " * 200},
        ],
    )
    with pytest.raises(UserError, match=r"p.jsonl: 1 prompts exceed .* = 112 tokens"):
        load_prompt_split(path, tok, DataConfig(max_seq_length=128, on_too_long="error"), 16)
    got = load_prompt_split(path, tok, DataConfig(max_seq_length=128), 16)
    assert got.num_skipped == 1 and len(got.prompts) == 3
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, return_dict=False
    )
    assert got.prompts[0].ids == got.prompts[1].ids == list(chat)
    assert got.prompts[2].ids == tok.encode("hello") and got.prompts[0].record["answer"] == "x"
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": ""}, "{nope", {"x": 1}, {"messages": [1]}])
    with pytest.raises(UserError) as e:
        load_prompt_split(bad, tok, DataConfig(), 16)
    lines = str(e.value).splitlines()
    assert lines[0] == "bad prompt data:" and len(lines) == 5
    assert "bad.jsonl:1: 'prompt' is empty" in lines[1] and "bad.jsonl:2: invalid JSON" in lines[2]


def test_the_prompt_sampler_walks_epochs_and_restores_its_key():
    from mlxlab.data.prompts import PromptSampler

    prompts = [Prompt([2, i], {"i": i}) for i in range(5)]
    a = PromptSampler(prompts, 2, seed=3)
    seen = [[p.record["i"] for p in a.next()] for _ in range(3)]
    assert len({i for b in seen[:2] for i in b}) == 4  # an epoch's batches hold distinct prompts
    state = json.loads(json.dumps(a.state()))
    b = PromptSampler(prompts, 2, seed=3)
    b.restore(state)
    assert [p.record["i"] for p in b.next()] == [p.record["i"] for p in a.next()]
    assert b.key == a.key
    with pytest.raises(UserError, match="same prompts and batch_size"):
        PromptSampler(prompts, 1, seed=3).restore(state)
    assert [len(x) for x in PromptSampler(prompts, 2, 0, shard=(1, 2)).one_pass()] == [1, 1, 0]


# --- rollouts ---------------------------------------------------------------------------------


def _tiny(family="llama"):
    from mlxlab.lora import apply as lora
    from mlxlab.models.zoo import load

    model, tok = load(f"tiny-{family}", "float32")
    from mlxlab.config import LoraConfig

    lora.apply(model, lora.plan(model, LoraConfig(targets=["q", "v"], rank=4)), seed=0)
    model.train()
    return model, tok


def test_rollouts_sample_groups_with_one_prefill_per_prompt(tiny_dir):
    from mlxlab.train.grpo.rollout import KeyedSampler, RolloutStats, rollout, step_key

    tiny_dir("llama")
    model, tok = _tiny()
    prompts = [tok.encode("hello there"), tok.encode("a longer prompt than that one")]

    def draw(key, share):
        stats = RolloutStats()
        out = rollout(model, tok, prompts, G, 12, KeyedSampler(key, 1.0), (), share, stats=stats)
        return [c.tokens for c in out], stats

    key = mx.random.key(5)
    shared, s1 = draw(key, True)
    again, _ = draw(key, True)
    _, other_key = step_key([int(x) for x in np.array(key)])
    other, _ = draw(other_key, True)
    alone, s2 = draw(key, False)
    assert shared == again and shared != other  # the key decides the draws
    assert len(shared) == 2 * G and all(1 <= len(t) <= 12 for t in shared)
    assert len({tuple(t) for t in shared[:G]}) > 1  # a group's completions differ
    n = [len(p) for p in prompts]
    assert s1.prefill_tokens == sum(n) + (G - 1) * 2  # each prompt once, then its last token
    assert s2.prefill_tokens == G * sum(n) and s1.completion_tokens == sum(map(len, shared))
    assert model.training is True  # put back after decoding in eval mode


def test_greedy_rows_decode_the_same_from_a_shared_prefill(tiny_dir):
    from mlxlab.train.grpo.rollout import rollout

    tiny_dir("gemma3")
    model, tok = _tiny("gemma3")
    prompts = [tok.encode("hello there"), tok.encode("a longer prompt than that one, with more")]
    shared = rollout(model, tok, prompts, 3, 16, None, (), True)
    alone = rollout(model, tok, prompts, 3, 16, None, (), False)
    assert [c.tokens for c in shared] == [c.tokens for c in alone]
    assert all(c.tokens == shared[0].tokens for c in shared[:3])


def test_stop_strings_end_a_completion_and_cut_its_text(tiny_dir):
    from mlxlab.train.grpo.rollout import KeyedSampler, rollout

    tiny_dir("llama")
    model, tok = _tiny()
    prompt = [tok.encode("hello")]
    free = rollout(model, tok, prompt, 8, 24, KeyedSampler(mx.random.key(1), 1.0))
    text = next(c.text for c in free if len(c.text) > 4)
    stop = text[2:4]
    cut = rollout(model, tok, prompt, 8, 24, KeyedSampler(mx.random.key(1), 1.0), [stop])
    for c in cut:
        assert stop not in c.text
        if c.finish == "stop" and c.tokens[-1] not in tok.eos_token_ids:
            assert stop in tok.decode(c.tokens) and stop not in tok.decode(c.tokens[:-1])
    assert any(stop in tok.decode(c.tokens) for c in cut)


# --- the loop ---------------------------------------------------------------------------------


def _write_prompts(tmp_path, n=8):
    letters = "aeiou"
    return _write(
        tmp_path / "prompts.jsonl",
        [{"prompt": f"say {letters[i % 5]} {i}", "letter": letters[i % 5]} for i in range(n)],
    )


def _run_cfg(tmp_path, name, **kw):
    from mlxlab.config import DataConfig, LoraConfig, OptimConfig

    grpo = dict(group_size=G, max_tokens=12, rewards=["tests.helpers.grpo_rewards:vowels"])
    grpo.update(kw.pop("grpo", {}))
    base = dict(
        model="tiny-llama",
        out_dir=str(tmp_path / name),
        objective="grpo",
        iters=4,
        batch_size=2,
        val_every=0,
        save_every=0,
        log_every=1,
        wandb="disabled",
        data=DataConfig(train=str(_write_prompts(tmp_path)), max_seq_length=64),
        lora=LoraConfig(targets=["q", "v", "down"], rank=4),
        optim=OptimConfig(lr=1e-2, schedule="constant"),
        grpo=GRPOConfig(**grpo),
    )
    base.update(kw)
    return TrainConfig(**base)


def _steps(run_dir):
    from pathlib import Path

    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_grpo_run_logs_its_rollouts_and_matches_across_backward_modes(tiny_dir, tmp_path):
    from pathlib import Path

    from mlxlab.config import BackwardConfig
    from mlxlab.train.cli import run

    tiny_dir("llama")
    full = run(_run_cfg(tmp_path, "full", grpo={"updates": 2, "beta": 0.1}))
    seg = run(
        _run_cfg(
            tmp_path,
            "seg",
            grpo={"updates": 2, "beta": 0.1},
            backward=BackwardConfig(mode="segmented", segment_size=1),
        )
    )
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "seg")
    assert len(a) == 4
    for key in ("loss", "reward", "reward_vowels_std", "kl", "clip_frac", "completion_len"):
        assert key in a[0]
    assert [r["loss_updates"] for r in a] == [r["loss_updates"] for r in b]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert all(r["kl"] > 0 for r in a)  # the second update of each step is off the reference
    assert any(r["grad_norm"] > 0 for r in a)
    assert (
        Path(full["adapter"], "adapters.safetensors").read_bytes()
        == Path(seg["adapter"], "adapters.safetensors").read_bytes()
    )
    lines = (tmp_path / "full" / "completions.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == 4 and len(first["completions"]) == 2 * G
    assert first["completions"][0]["reward"] == first["completions"][0]["reward_vowels"]


def test_a_resumed_grpo_run_draws_and_trains_as_the_uninterrupted_one(tiny_dir, tmp_path):
    """The checkpoint holds the prompt position and the rollouts' key: a run stopped after step 1
    and resumed gives the same completions, rewards, losses and adapter as one that never
    stopped (constant LR, so the shorter first leg follows the same schedule)."""
    import dataclasses as dc
    from pathlib import Path

    from mlxlab.train.cli import run

    tiny_dir("llama")
    whole = run(_run_cfg(tmp_path, "whole", val_every=2))
    cfg = _run_cfg(tmp_path, "legs", iters=2, save_every=1, val_every=2)
    run(cfg)
    ckpt = json.loads(
        (tmp_path / "legs" / "checkpoints" / "step_0000001" / "trainer_state.json").read_text()
    )
    assert ckpt["seconds"] > 0 and ckpt["peak_mem_gb"] > 0
    resumed = run(dc.replace(cfg, iters=4, resume=True))
    assert resumed["start_step"] == resumed["resumed_from_step"] == 1
    # the whole run's training time and peak memory: the checkpoint's and this attempt's
    assert resumed["seconds"] == pytest.approx(ckpt["seconds"] + resumed["resumed_seconds"])
    assert resumed["peak_mem_gb"] == max(ckpt["peak_mem_gb"], resumed["resumed_peak_mem_gb"])
    a, b = _steps(tmp_path / "whole"), _steps(tmp_path / "legs")
    for key in ("loss", "reward", "completion_len"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    assert [r["val_reward"] for r in a if "val_reward" in r] == [
        r["val_reward"] for r in b if "val_reward" in r
    ]
    assert len({r["reward"] for r in a if "reward" in r}) > 1
    assert (tmp_path / "whole" / "completions.jsonl").read_text() == (
        tmp_path / "legs" / "completions.jsonl"
    ).read_text()
    assert (
        Path(whole["adapter"], "adapters.safetensors").read_bytes()
        == Path(resumed["adapter"], "adapters.safetensors").read_bytes()
    )


def test_grpo_from_an_adapter_keeps_it_as_the_kl_reference(tiny_dir, tmp_path):
    """lora.init: the run starts from that adapter and it is the reference, so the first step's
    KL is 0; against the base model (no lora.init) the same adapter's KL is not."""
    import dataclasses as dc

    from mlxlab.train.cli import run

    tiny_dir("llama")
    first = run(_run_cfg(tmp_path, "first", iters=2))
    lora = dc.replace(_run_cfg(tmp_path, "x").lora, init=first["adapter"])
    on_top = run(_run_cfg(tmp_path, "top", iters=1, lora=lora, grpo={"beta": 0.1}))
    assert on_top["start_step"] == 0
    assert _steps(tmp_path / "top")[0]["kl"] == 0.0
    from mlxlab.lora import io as lora_io
    from mlxlab.models.zoo import load

    model, _ = load("tiny-llama", "float32")
    lora_io.load(model, first["adapter"])
    _, _, (batch,), _ = _batches("grpo")  # completions of tiny-llama's vocabulary
    policy = L.position_logps(model, batch)
    assert not np.array_equal(
        np.array(policy), np.array(L.position_logps(model, batch, None, True))
    )


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(grpo=GRPOConfig(max_tokens=64)), "leaves no room for a prompt"),
        (dict(grad_accum=9), "grad_accum=9 exceeds the 8 completions"),
    ],
)
def test_grpo_config_errors(tmp_path, kw, message):
    from mlxlab.config import BackwardConfig, DataConfig

    base = dict(objective="grpo", batch_size=1, data=DataConfig(max_seq_length=64))
    with pytest.raises(UserError, match=message):
        TrainConfig(**{**base, **kw})
    with pytest.raises(UserError, match="backward.pipeline"):
        TrainConfig(objective="grpo", backward=BackwardConfig(mode="segmented", pipeline=True))
    with pytest.raises(UserError, match="data.pack is for SFT"):
        TrainConfig(objective="grpo", data=DataConfig(pack=True))


def test_grpo_overrides_compose_from_the_command_line():
    from mlxlab.cli import compose

    cfg = compose(
        "train",
        [
            "objective=grpo",
            "grpo.loss=dapo",
            "grpo.rewards=[json,match,tests.helpers.grpo_rewards:vowels]",
            "grpo.reward_weights=[1,1,0.5]",
            "grpo.updates=2",
        ],
    )
    assert cfg.grpo.rewards[2] == "tests.helpers.grpo_rewards:vowels"
    assert (cfg.grpo.clip, cfg.grpo.scale, cfg.grpo.drops_uniform_groups) == (
        (0.2, 0.28),
        "group",
        True,
    )
    assert compose("train", ["objective=grpo", "grpo.loss=dr_grpo"]).grpo.scale == "none"
    assert compose("train", ["grpo.loss=gspo", "grpo.epsilon=0.01"]).grpo.clip == (0.01, 0.01)
    exp = compose("train", ["+exp=grpo_json"])
    assert exp.objective == "grpo" and exp.grpo.stop == ["\n"] and exp.grpo.group_size == 8


# --- data parallel (slow: each starts two ranks on loopback, as mlx.launch does) -------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["grpo", "dapo"])
def test_data_parallel_update_is_the_ranks_shares_summed(tiny_dir, session_home, tmp_path, variant):
    """Each rank holds one group (its own reference pass, its own loss units); the all-summed
    gradient is bit for bit one process computing the two shares one after the other, added."""
    import os
    import subprocess
    import sys

    from tests.helpers.cli import REPO
    from tests.helpers.dist import start_ranks, wait_all

    env = {"OPENBLAS_NUM_THREADS": "1", "MLXLAB_HOME": str(session_home)}
    args = [str(tmp_path / "dp.npz"), variant]
    ranks = start_ranks(args, 2, tmp_path, env, "tests.helpers.grpo_dist_step")
    for rank, (code, _, err) in enumerate(wait_all(ranks)):
        assert code == 0, (rank, err[-2000:])
    one = subprocess.run(
        [sys.executable, "-m", "tests.helpers.grpo_dist_step", str(tmp_path / "one.npz"), variant],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    dp, shares, whole = (np.load(tmp_path / f"{n}.npz") for n in ("dp", "one_shares", "one"))
    assert sorted(dp.files) == sorted(whole.files) and len(dp.files) > 2
    for k in dp.files:
        assert np.array_equal(dp[k], shares[k]), k
    assert float(dp["loss"]) == pytest.approx(float(whole["loss"]), rel=1e-5, abs=1e-7)
    assert float(dp["grad_norm"]) > 0


@pytest.mark.slow
def test_a_data_parallel_grpo_run_resumes_to_the_same_adapter(tiny_dir, session_home, tmp_path):
    """Two ranks, each rolling out one of a step's two prompts: the world's reward figures and
    per-rank peaks are logged; stopped after step 1 and resumed (rank 0 restores, the key and
    the position go to rank 1), the run ends with the uninterrupted run's records and adapter."""
    from tests.helpers.dist import start_ranks, wait_all

    tiny_dir("llama")
    env = {"OPENBLAS_NUM_THREADS": "1", "MLXLAB_HOME": str(session_home)}
    data = _write_prompts(tmp_path)

    def args(out, *extra):
        return [
            "train", "model=tiny-llama", "objective=grpo", f"out_dir={out}",
            f"data.train={data}", "data.max_seq_length=64", "batch_size=2", "log_every=1",
            "val_every=0", "wandb=disabled", "lora.targets=[q,v,down]", "lora.rank=4",
            "optim.lr=1e-2", "optim.schedule=constant", f"grpo.group_size={G}",
            "grpo.max_tokens=12", "grpo.rewards=[tests.helpers.grpo_rewards:vowels]", *extra,
        ]  # fmt: skip

    def run(out, *extra):
        done = wait_all(start_ranks(args(out, *extra), 2, tmp_path, env))
        assert [c for c, _, _ in done] == [0, 0], done[0][2][-3000:] + done[1][2][-2000:]
        return done

    run(tmp_path / "whole", "iters=3")
    run(tmp_path / "legs", "iters=2", "save_every=1")
    resumed = run(tmp_path / "legs", "iters=3", "save_every=1", "resume=true")
    assert "resumed from" in resumed[0][2]
    a, b = _steps(tmp_path / "whole"), _steps(tmp_path / "legs")
    assert len(a) == 3 and len(a[0]["peak_mem_gb_ranks"]) == 2
    lines = (tmp_path / "whole" / "completions.jsonl").read_text().splitlines()
    assert len(json.loads(lines[0])["completions"]) == G  # rank 0's share: one prompt's group
    for key in ("loss", "reward", "reward_std", "completion_len", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert len({r["reward"] for r in a}) > 1
    assert (tmp_path / "whole" / "adapter" / "adapters.safetensors").read_bytes() == (
        tmp_path / "legs" / "adapter" / "adapters.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("kind", ["dora", "full"])
def test_grpo_kl_reference_of_dora_and_full_is_the_starting_model(tiny_dir, tmp_path, kind):
    """DoRA's magnitudes and a full fine-tune's weights have no off switch: their starting arrays
    are the KL reference, so the first step's KL is 0 and, once the weights move, it is not."""
    import dataclasses as dc

    from mlxlab.train.cli import run

    tiny_dir("llama")
    lora = dc.replace(_run_cfg(tmp_path, "x").lora, type=kind)
    run(_run_cfg(tmp_path, kind, iters=3, lora=lora, grpo={"beta": 0.1, "updates": 1}))
    kl = [r["kl"] for r in _steps(tmp_path / kind) if "kl" in r]
    assert kl[0] == 0.0 and kl[-1] > 0, kl
