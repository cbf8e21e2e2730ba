"""The proposers and the schedule without a target: prompt lookup by hand, the draft model's rollback by its
histories, the adaptive k, bad settings named."""

import numpy as np
import pytest

from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.speculative import AdaptiveK, DraftProposer, NgramProposer, NgramSettings, Proposal, ngram_lookup
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


def test_k_halves_on_rejection_grows_on_full_acceptance_and_probes_after_plain_steps():
    schedule = AdaptiveK(k_max=4, probe_after=3)
    assert [schedule.update(p, a) for p, a in [(4, 0), (2, 1), (2, 2), (4, 4), (0, 0), (4, 0), (2, 0), (1, 0)]] \
        == [2, 2, 4, 4, 4, 2, 1, 0]
    assert schedule.plain_run == 3
    assert [schedule.update(0, 0) for _ in range(3)] == [0, 0, 1]  # three plain steps, then one draft again
    assert schedule.plain_run == 0 and schedule.update(1, 0) == 0 and schedule.update(0, 0, steps=3) == 1
    fixed = AdaptiveK(k_max=4, adaptive=False)
    assert fixed.update(4, 0) == 4
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=-1)
