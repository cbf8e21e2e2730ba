"""The proposers and the schedule without a target: prompt lookup by hand, the draft model's rollback by its
histories, the adaptive k, bad settings named."""

import jax
import numpy as np
import pytest

from jaxattn.config import ModelConfig
from jaxattn.decoding import generate
from jaxattn.kernels import Kernels
from jaxattn.speculative import draft as draft_module
from jaxattn.speculative import AdaptiveK, DraftProposer, NgramProposer, NgramSettings, Proposal, ngram_lookup
from jaxattn.speculative.schedule import (COST_WINDOW, MAX_PROBE_GAP, PLAIN_EVERY, PRIOR_DRAFT_COST, DraftCosts, expected_tokens,
                                        widths)
from tiny_models import drawn_params


def test_ngram_lookup_copies_what_followed_the_latest_longest_match():
    history = [7, 1, 2, 3, 9, 8, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    np.testing.assert_array_equal(ngram_lookup(history, k=3, n_min=1, n_max=3), [4, 5, 6])  # latest "1 2 3"
    np.testing.assert_array_equal(ngram_lookup(history, k=2, n_min=1, n_max=1), [4, 5])  # latest "3"
    assert ngram_lookup([1, 2, 3, 4], k=3, n_min=1, n_max=2).size == 0  # nothing repeats
    assert ngram_lookup([5], k=3).size == 0


def test_ngram_lookup_prefers_the_longer_match():
    history = [4, 2, 3, 1, 9, 9, 2, 3, 6, 6, 4, 2, 3]  # "2 3" latest at 6, "4 2 3" only at 0
    np.testing.assert_array_equal(ngram_lookup(history, k=2, n_min=1, n_max=3), [1, 9])
    np.testing.assert_array_equal(ngram_lookup(history, k=2, n_min=1, n_max=2), [6, 6])


def test_ngram_lookup_near_the_end_of_a_repeat_runs_on_cyclically():
    np.testing.assert_array_equal(ngram_lookup([5, 1, 2, 1, 2, 1, 2], k=5, n_max=2), [1, 2, 1, 2, 1])
    np.testing.assert_array_equal(ngram_lookup([3, 3, 3], k=4, n_max=2), [3, 3, 3, 3])


def test_the_ngram_proposer_pads_rows_to_k():
    proposal = NgramProposer(NgramSettings(n_min=1, n_max=2, k=3)).propose([np.array([1, 2, 1]), np.array([4])], 3)
    np.testing.assert_array_equal(proposal.tokens, [[2, 1, 2], [0, 0, 0]])
    np.testing.assert_array_equal(proposal.num, [3, 0])
    assert Proposal.from_rows([], 2).tokens.shape == (0, 2)


@pytest.mark.parametrize("changes, named", [(dict(n_min=0), "n_min"), (dict(k=0), "k"), (dict(n_max=2.0), "n_max"),
                                            (dict(n_min=3, n_max=2), "n_max must be >= n_min")])
def test_bad_ngram_settings_are_named(changes, named):
    with pytest.raises(ValueError, match=named):
        NgramSettings(**changes)


def test_the_draft_proposer_rolls_back_to_what_the_history_still_agrees_with():
    """Drafting after a history the target cut short gives the drafts of that history from scratch."""
    config = ModelConfig(vocab_size=17, d_model=32, num_layers=1, num_heads=4, max_seq_len=64)
    params = drawn_params(config, seed=2, std=0.3)
    history = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    drafter = DraftProposer(params, config, k=4, kernels=Kernels())
    drafter.begin(1, 32)
    first = drafter.propose([history], 4).tokens[0]
    kept = np.concatenate([history, first[:2], [(first[2] + 1) % 17]])  # two drafts kept, the third replaced
    after_rollback = drafter.propose([kept], 4).tokens[0]
    fresh = DraftProposer(params, config, k=4, kernels=Kernels())
    fresh.begin(1, 32)
    np.testing.assert_array_equal(after_rollback, fresh.propose([kept], 4).tokens[0])
    np.testing.assert_array_equal(first[:2], fresh.propose([history], 2).tokens[0])
    with pytest.raises(ValueError, match="begin"):
        DraftProposer(params, config, k=2).propose([history], 2)


def measured(plain: float, per_width: dict[int, float], k: int = 4, rows: int = 1) -> DraftCosts:
    """Costs of steps timed twice each (the first timing of a shape is left out: it may have compiled)."""
    costs = DraftCosts(widths(k))
    for drafts, seconds in [(0, plain), *((w - 1, s) for w, s in per_width.items())]:
        for _ in range(2):
            costs.observe(rows, drafts, seconds)
    return costs


def test_a_long_catch_up_is_fed_in_pieces_and_drafts_what_greedy_decoding_gives(monkeypatch):
    """Rows that went without drafting for longer than CATCH_UP tokens (two rows, 100 and 40 unseen) are fed in
    pieces by one program width; the drafts are the draft model's greedy continuation of each history."""
    config = ModelConfig(vocab_size=17, d_model=32, num_layers=1, num_heads=4, max_seq_len=160)
    params = drawn_params(config, seed=4, std=0.3)
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 17, 100).astype(np.int32), rng.integers(0, 17, 40).astype(np.int32)]
    widths_fed = []
    feed = draft_module.feed_tokens

    def counting(params, cache, tokens, num, **static):
        widths_fed.append(tokens.shape[1])
        return feed(params, cache, tokens, num, **static)

    monkeypatch.setattr(draft_module, "feed_tokens", counting)
    drafter = DraftProposer(params, config, k=3, kernels=Kernels())
    drafter.begin(2, 128)
    drafts = drafter.propose(histories, 3).tokens
    assert widths_fed and set(widths_fed) == {draft_module.CATCH_UP}  # 100 - 32 unseen tokens in pieces of 32
    for history, row in zip(histories, drafts):
        out = generate(params, config, history[None], np.array([len(history)]), max_new_tokens=3,
                       rng=jax.random.PRNGKey(0), temperature=0.0, kernels=Kernels())
        np.testing.assert_array_equal(row, np.asarray(out.tokens)[0])


def test_expected_tokens_and_the_widths_a_draft_count_runs_in():
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert widths(4) == (2, 3, 5) and widths(1) == (2,) and widths(6) == (2, 3, 5, 7)
    costs = DraftCosts(widths(4))
    assert [costs.width(d) for d in range(5)] == [1, 2, 3, 5, 5]  # 3 drafts pay for the width of 4
    assert costs.candidates(4) == (0, 1, 2, 4) and costs.candidates(2) == (0, 1, 2)


def test_draft_costs_leave_out_each_shape_s_first_timing_and_shrug_off_a_slow_step():
    costs = DraftCosts(widths(4))
    assert costs.relative(1, 0) == 1.0 and costs.relative(1, 2) == pytest.approx(1 + 2 * PRIOR_DRAFT_COST)
    costs.observe(1, 0, 5.0)  # a first step: may have compiled, left out
    costs.observe(1, 1, 9.0)
    assert costs.timings == {} and costs.relative(1, 1) == pytest.approx(1 + PRIOR_DRAFT_COST)
    costs.observe(1, 0, 0.010)
    costs.observe(1, 1, 0.015)
    costs.observe(1, 1, 0.015)
    assert costs.relative(1, 1) == pytest.approx(1.5) and costs.seconds(1, 2) == 0.015
    assert costs.relative(4, 1) == pytest.approx(1 + PRIOR_DRAFT_COST)  # other rows: not measured
    costs.observe(1, 1, 0.500)  # one slow step (another process, a collection): the lower median ignores it
    assert costs.seconds(1, 2) == 0.015
    for _ in range(COST_WINDOW):  # the machine got slower for good: the window follows
        costs.observe(1, 1, 0.030)
    assert costs.seconds(1, 2) == 0.030 and costs.relative(1, 1) == pytest.approx(3.0)


def test_a_row_that_always_drafts_still_times_a_plain_step_every_so_often():
    costs = DraftCosts(widths(4))
    wanted = []
    for _ in range(3 * PLAIN_EVERY):
        wanted.append(costs.wants_plain(1))
        costs.observe(1, 0 if wanted[-1] else 1, 0.010 if wanted[-1] else 0.015)
    assert [i for i, w in enumerate(wanted) if w] == [PLAIN_EVERY - 1, 2 * PLAIN_EVERY - 1]  # the first left out
    assert costs.knows_plain(1) and not costs.knows_plain(2) and costs.relative(1, 1) == pytest.approx(1.5)


def test_k_maximises_expected_tokens_per_cost():
    cheap = measured(0.010, {2: 0.0105, 3: 0.011, 5: 0.012})  # float32 at batch 1: drafts cost little
    costly = measured(0.010, {2: 0.013, 3: 0.016, 5: 0.024})  # a quantized step's: each row costs
    for costs in (cheap, costly):
        schedule = AdaptiveK(4, costs=costs)
        for _ in range(30):
            schedule.update(schedule.k, schedule.k)  # every draft kept: the acceptance nears 1
        assert schedule.k == 4 and schedule.acceptance > 0.9
    cheap_k, costly_k = AdaptiveK(4, costs=cheap), AdaptiveK(4, costs=costly)
    for schedule in (cheap_k, costly_k):
        for _ in range(30):
            schedule.update(2, 1)  # one kept in two tried, as a summary's drafts
    assert cheap_k.k == 4 and costly_k.k == 1  # the same acceptance: long drafts only where they are cheap
    for schedule in (cheap_k, costly_k):
        for _ in range(30):
            schedule.update(max(schedule.k, 1), 0)  # everything rejected
    assert costly_k.k == 0 and cheap_k.acceptance < 0.15
    assert cheap_k.k == 1  # a draft costing 5% of a step still pays at an acceptance above 5%
    for schedule in (cheap_k, costly_k):  # the choice is the argmax of E(d) / c(d) over the candidates
        best = max(schedule.costs.candidates(4), key=lambda d: (expected_tokens(schedule.acceptance, d)
                                                                 / schedule.costs.relative(1, d), -d))
        assert schedule.best() == best


def test_a_backed_off_row_probes_and_a_rejected_probe_doubles_the_wait():
    schedule = AdaptiveK(4, probe_after=3, costs=measured(0.010, {2: 0.016, 3: 0.019, 5: 0.024}))
    for _ in range(5):
        schedule.update(max(schedule.k, 1), 0)
    assert schedule.k == 0 and schedule.plain_run == 3
    gaps = []
    for _ in range(5):
        steps = 0
        while schedule.update(0, 0) == 0:
            steps += 1
        gaps.append(steps + 1)
        assert schedule.k == 1 and schedule.plain_run == 0
        schedule.update(1, 0)  # the probe's draft rejected
    assert gaps == [3, 6, 12, 24, 24]  # up to MAX_PROBE_GAP * probe_after
    assert 24 == MAX_PROBE_GAP * 3
    while schedule.update(0, 0, steps=24) == 0:
        pass
    for _ in range(20):  # a probe kept: the text repeats again, the wait goes back to probe_after
        schedule.update(max(schedule.k, 1), max(schedule.k, 1))
    assert schedule.k == 4 and schedule.gap == 3


def test_k_follows_the_rows_a_step_holds_and_a_fixed_k_stays():
    costs = measured(0.010, {2: 0.0105, 3: 0.011, 5: 0.012}, rows=1)
    for drafts, seconds in [(0, 0.020), (1, 0.040), (2, 0.060), (4, 0.100)]:  # 8 rows: a draft costs a step
        for _ in range(2):
            costs.observe(8, drafts, seconds)
    schedule = AdaptiveK(4, costs=costs)
    for _ in range(10):
        schedule.update(2, 1)
    assert schedule.for_rows(1) == 4 and schedule.for_rows(8) == 0
    fixed = AdaptiveK(k_max=4, adaptive=False, costs=costs)
    assert fixed.update(4, 0) == 4 and fixed.for_rows(8) == 4
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=-1)
