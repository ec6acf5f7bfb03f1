"""`klcheck lm` (nanogrpo/lab/klcheck_lm.py) on the tiny model, a small setting: what a small sample can show.
On-policy, the exact sequence-level forms' 95% CIs cover the reverse-KL gradient, k1 in the loss has a gradient
indistinguishable from 0, and the checker is not blind: k2 summed into the reward (no estimate of that
gradient) is told apart from it, and so are the per-prefix gradients at T = 16."""

from __future__ import annotations

import json

import pytest

from nanogrpo.lab import klcheck, klcheck_lm


@pytest.fixture(scope="module")
def recs():
    c = klcheck_lm.LMCheck(
        model="tiny", lengths=(16,), distances=(1.0,), regimes=("on",), samples=768, batch=32
    )
    return {r["variant"]: r for r in klcheck_lm.run(c, progress=False)}


def test_every_variant_of_the_toy_table_is_reported_with_cis(recs):
    assert {v.name for v in klcheck.variants(2)} <= set(recs)
    for r in recs.values():
        assert r["rev/rel_err_lo"] <= r["rev/rel_err"] <= r["rev/rel_err_hi"] and r["samples"] == 768


@pytest.mark.parametrize("variant", ["loss k1 seq +IS", "loss k3 seq +IS", "reward k1 sum, no baseline",
                                     "reward k1 sum, rloo G=2"])  # fmt: skip
def test_the_exact_sequence_forms_cover_the_reverse_kl_gradient(recs, variant):
    assert "rev" in recs[variant]["matches"]


def test_k1_in_the_loss_is_indistinguishable_from_zero_on_policy(recs):
    assert recs["loss k1 token"]["zero"] and recs["loss k1 seq"]["zero"]
    assert not recs["target tok_rev"]["zero"]  # a gradient that is there is told from 0


def test_the_checker_tells_a_wrong_gradient_from_the_reverse_kl(recs):
    assert "rev" not in recs["reward k2 sum, no baseline"]["matches"]
    assert recs["target tok_rev"]["rev/rel_err_lo"] > 0  # the per-prefix gradient misses a share of it


def test_the_command_prints_json(capsys):
    klcheck.main(["lm", "--json", "--model", "tiny", "--lengths", "4", "--distances", "1", "--regimes", "off",
                  "--samples", "48", "--batch", "16"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert {r["regime"] for r in out} == {"off"} and "away/rel_err" in out[0]
