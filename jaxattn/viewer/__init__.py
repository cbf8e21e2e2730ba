"""An interactive attention viewer in one self-contained HTML page (no network when it is opened).

* `attention_page(weights [L, N, T, S], tokens, layers=..., title=...)`: the page as a string,
  for a file or `IPython.display.HTML`; head view (lines from queries to keys), model view
  (every layer x head as a thumbnail) and matrix view (one head's heat map).
* `describe_layers(config)`: each layer's kind and label (MHA/GQA/MQA/MLA, GQA groups, local
  window, no RoPE, sinks) as the page shows them.
* `model_attention_page(config, params, token_ids, tokens)`: both, from a model and one sequence.
* `MAX_TOKENS`: the longest sequence a page shows.

`python -m train.attention_maps --html maps.html` writes one from a checkpoint, a transformers
directory or a freshly initialised config.
"""

from jaxattn.viewer.layers import describe_layers, visible_token
from jaxattn.viewer.page import MAX_TOKENS, attention_page, model_attention_page, page_data

__all__ = ["MAX_TOKENS", "attention_page", "describe_layers", "model_attention_page", "page_data", "visible_token"]
