"""Speculative decoding: drafted tokens checked by the target model k at a time (docs/speculative.md).

A proposer drafts up to k tokens per row; the target scores the row's last token and the drafts in one
forward pass, keeps the longest acceptable prefix, emits one token of its own after it and rolls its
cache back past the first rejection. Greedy output is greedy decoding's; sampled output has the
sampler's distribution (rejection sampling).

The modules, one job each:

* `proposal`: the proposers' one interface (`Proposer`, `Proposal`);
* `ngram`: prompt lookup (`NgramProposer`, `NgramSettings`, `ngram_lookup`), on the host;
* `draft`: a small model of the same tokenizer drafting greedily with its own cache (`DraftProposer`);
* `acceptance`: the pure, jittable acceptance rules over `[B, k, V]` arrays (`greedy_accept`,
  `rejection_accept`, `accept`, `target_probs`, `point_mass`), for any caller with batched logits;
* `verify`: the target's step over its dense cache (`verify_step`, `prefill`, `rollback`);
* `schedule`: how many drafts pay, from the acceptance and the measured cost of a wider step (`AdaptiveK`,
  `DraftCosts`);
* `stats`: what a generation did (`SpeculativeStats`);
* `generate`: the host loop, `speculative_generate`, with `jaxattn.generate`'s contract;
* `options`: the method and its settings as one value (`SpeculativeOptions`, `parse_speculative` of
  `ngram:k=4` or `draft:DIR`, `make_proposer`), for command lines.
"""

from jaxattn.speculative.acceptance import accept, greedy_accept, point_mass, rejection_accept, target_probs
from jaxattn.speculative.draft import DraftProposer
from jaxattn.speculative.generate import SpeculativeOutput, speculative_generate
from jaxattn.speculative.ngram import NgramProposer, NgramSettings, ngram_lookup
from jaxattn.speculative.options import SpeculativeOptions, make_proposer, parse_speculative
from jaxattn.speculative.proposal import Proposal, Proposer
from jaxattn.speculative.schedule import AdaptiveK, DraftCosts
from jaxattn.speculative.stats import SpeculativeStats
from jaxattn.speculative.verify import prefill, rollback, verify_step

__all__ = [
    "AdaptiveK",
    "DraftCosts",
    "DraftProposer",
    "NgramProposer",
    "NgramSettings",
    "Proposal",
    "Proposer",
    "SpeculativeOptions",
    "SpeculativeOutput",
    "SpeculativeStats",
    "accept",
    "greedy_accept",
    "make_proposer",
    "ngram_lookup",
    "parse_speculative",
    "point_mass",
    "prefill",
    "rejection_accept",
    "rollback",
    "speculative_generate",
    "target_probs",
    "verify_step",
]
