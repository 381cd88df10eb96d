"""The preference objectives' formulas on a tiny fixed case, against numbers worked out by hand
from the published formulas (the literals below; not from the code under test)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxlab.train import objectives

# two pairs: summed response log-probs of the policy and the reference, and token counts
PI_C, PI_R = mx.array([-2.0, -3.0]), mx.array([-4.0, -2.5])
REF_C, REF_R = mx.array([-2.5, -3.0]), mx.array([-3.5, -3.0])
N_C, N_R = mx.array([4.0, 6.0]), mx.array([8.0, 5.0])


def test_dpo_sigmoid():
    # h = beta * ((pi_c - pi_r) - (ref_c - ref_r)) = 0.1 * [1.0, -0.5]
    # loss = mean(log(1 + e^-h)) = mean(log(1 + e^-0.1), log(1 + e^0.05))
    loss, m = objectives.dpo(PI_C, PI_R, REF_C, REF_R, beta=0.1)
    assert loss.item() == pytest.approx((0.6443966600735709 + 0.7184596480132863) / 2, rel=1e-6)
    # rewards: 0.1 * (pi - ref): chosen [0.05, 0], rejected [-0.05, 0.05]
    assert m["reward_chosen"].item() == pytest.approx(0.025, abs=1e-7)
    assert m["reward_rejected"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["reward_margin"].item() == pytest.approx(0.025, abs=1e-7)
    assert m["pref_accuracy"].item() == 0.5
    assert m["logp_chosen"].item() == -2.5 and m["logp_rejected"].item() == -3.25


def test_dpo_label_smoothing():
    # (1 - 0.1) log(1 + e^-h) + 0.1 log(1 + e^h), averaged over h = 0.1, -0.05
    loss, _ = objectives.dpo(PI_C, PI_R, REF_C, REF_R, beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.6839281540434285, rel=1e-6)


def test_ipo():
    # per-token means: logits = (pi_c/n_c - pi_r/n_r) - (ref_c/n_c - ref_r/n_r) = [0.1875, -0.1]
    # loss = mean((logits - 1 / (2 * 0.1))^2) = ((0.1875 - 5)^2 + (-0.1 - 5)^2) / 2
    loss, _ = objectives.dpo(PI_C, PI_R, REF_C, REF_R, beta=0.1, loss="ipo", n_c=N_C, n_r=N_R)
    assert loss.item() == pytest.approx(24.585078125, rel=1e-6)
    with pytest.raises(ValueError, match="token counts"):
        objectives.dpo(PI_C, PI_R, REF_C, REF_R, beta=0.1, loss="ipo")
    with pytest.raises(ValueError, match="unknown DPO loss"):
        objectives.dpo(PI_C, PI_R, REF_C, REF_R, beta=0.1, loss="hinge2")


def test_orpo():
    # chosen sums [-2, -3] over [4, 6] tokens: means -0.5, -0.5; rejected [-6, -5] over [4, 5]:
    # means -1.5, -1.0. log odds(m) = m - log(1 - e^m); pair log-odds ratios 1.68027, 0.97408;
    # log sigmoid of them -0.170859, -0.320300; NLL(chosen) = 5 / 10 = 0.5;
    # loss = 0.5 - 0.25 * mean(-0.170859, -0.320300)
    loss, m = objectives.orpo(
        mx.array([-2.0, -3.0]),
        mx.array([-6.0, -5.0]),
        mx.array([4.0, 6.0]),
        mx.array([4.0, 5.0]),
        lam=0.25,
    )
    assert loss.item() == pytest.approx(0.5613948752980019, rel=1e-6)
    assert m["nll_chosen"].item() == pytest.approx(0.5)
    assert m["log_odds_ratio"].item() == pytest.approx(
        (1.6802696706417346 + 0.9740769841801067) / 2, rel=1e-6
    )
    assert m["pref_accuracy"].item() == 1.0


def test_log1mexp_is_stable_at_both_ends():
    x = mx.array([-1e-7, -0.5, -50.0], dtype=mx.float32)
    out = objectives._log1mexp(x)
    # log(1 - e^x): ~log(1e-7) near 0, log(1 - e^-0.5), ~ -e^-50 far out
    assert out[0].item() == pytest.approx(-16.118095, rel=1e-4)
    assert out[1].item() == pytest.approx(-0.9327521295671886, rel=1e-6)
    assert out[2].item() == pytest.approx(-1.9287498479639178e-22, rel=1e-3)
