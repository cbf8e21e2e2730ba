"""Drawing many samples from a model on one machine, for `python -m train.sample`.

* `memory`: what a run of N samples of M new tokens holds at its peak (`MemoryEstimate`), how many
  samples one call draws, and the plan that refuses (or warns about) a run this machine cannot hold;
* `calls`: the samples drawn call by call and window by window (`sample`), each call with its own key,
  stoppable between windows, a token drawn from logits that are not finite named in one line;
* `speculative`: `--speculative SPEC`, the samples drawn by `jaxattn.speculative_generate` (prompt lookup or
  a draft model loaded as the target is), with the drafts' statistics.
"""
