"""A draft model for speculative decoding, distilled from its target (`python -m train.distill_draft`).

  prompts: the chat requests the target replies to (free, passages to summarise, code to edit).
  corpus: the target's replies and plain-text windows as rows, with the target's top logits.
  draft: the draft cut from the target's layers, and written as a transformers directory.
  fit: the draft's distribution fitted to the target's, and its top-1 agreement on held-out replies.
"""
