"""The Flax modules a model is built from, each from one `ModelConfig` and one `Kernels`.

* `jaxattn.layers.primitives`: `Linear`, `RMSNorm`, `LayerNorm`, the dense `MLP`;
* `jaxattn.layers.attention_layer`: `AttentionLayer`, the one skeleton of every attention layer,
  written once over named steps;
* `jaxattn.layers.gqa` (`Attention`: MHA, GQA, MQA) and `jaxattn.layers.mla`
  (`MultiHeadLatentAttention`): each kind's steps and what it caches per token;
* `jaxattn.layers.kinds`: which attention kind a config asks for (`attention_class`);
* `jaxattn.layers.moe`: the mixture-of-experts MLP and its router;
* `jaxattn.layers.absolute_positions`: the absolute positions added to the embeddings;
* `jaxattn.layers.block`: the transformer `Block` (attention and MLP on the residual stream) and the
  scanned period of blocks (`LayerPeriod`, `scanned_layers`) that `jaxattn.model.DecoderLM` stacks.

The package imports none of them (the public ones are also `jaxattn.Attention`, `jaxattn.MLP`, ...).
"""
