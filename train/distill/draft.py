"""A draft model cut from its target, and written as a transformers directory.

`cut(params, config, layers, init)` keeps the target's width, heads, vocabulary, embedding, final norm
and head, and `layers` of its blocks:

* "first" (the default): the first `layers` blocks. The head then reads an early layer's stream, which
  it was never trained on, yet the cut's top-1 already agrees with the target's on a few reply tokens
  in a hundred, and training moves on from there;
* "ends": the first `layers - 1` blocks and the last one. The last block, fed an early layer's stream
  instead of the one it was trained on, writes what the head turns into nonsense: the cut agrees with
  the target on next to no token before training, and its loss starts far higher.

Trained side by side for the same minutes on the same data, the two reach about the same agreement,
"first" a little ahead at each measurement (docs/speculative.md, "A draft model made here"), and it
needs no minutes to undo what the last block writes: so it is the default.

`save(out, config, params, tokenizer, chat)` writes the draft with `jaxattn.hf.save_pretrained` (the
transformers architecture of the target's family), with the target's tokenizer, its chat template as
chat_template.jinja and its named special tokens in tokenizer_config.json, as `python -m train.export
--gguf` writes a GGUF file: a directory that `train.models.load.load_model(ModelSource(hf=out))`
loads (`python -m train.sample --hf DIR`), and `jaxattn.speculative.DraftProposer` drafts with.
"""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn

from jaxattn import hf
from jaxattn.config import ModelConfig
from jaxattn.hf import SaveReport
from jaxattn.scan_plan import relayout

INITS = ("first", "ends")


def kept_layers(num_layers: int, layers: int, init: str) -> list[int]:
    """The target's block indices a cut of `layers` keeps, in order."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if not 1 <= layers < num_layers:
        raise ValueError(f"a draft keeps 1 to {num_layers - 1} of the target's {num_layers} layers, not {layers}")
    if init == "first" or layers == 1:
        return list(range(layers))
    return [*range(layers - 1), num_layers - 1]


def check_cuttable(config: ModelConfig) -> None:
    """ValueError for a target whose layers differ from each other (a layer pattern, dense and MoE layers,
    value embeddings), which a cut would mix up."""
    odd = [name for name, value in (("layer_pattern", config.layer_pattern), ("moe", config.moe),
                                    ("dense_layers", config.dense_layers),
                                    ("value_embeddings", config.value_embeddings)) if value]
    if odd:
        raise ValueError(f"a draft is cut from a target whose layers are all alike; this one has {', '.join(odd)}")


def cut(params, config: ModelConfig, layers: int, init: str = "ends") -> tuple[dict, ModelConfig]:
    """`(params, config)` of the draft: `config` with `layers` layers, its blocks `kept_layers` of the target's
    (renumbered from 0), every other parameter the target's (shared arrays, not copies)."""
    check_cuttable(config)
    params, config = relayout(nn.unbox(params), config, scan_layers=False)
    kept = kept_layers(config.num_layers, layers, init)
    draft = {name: value for name, value in params.items() if not name.startswith("blocks_")}
    draft.update({f"blocks_{i}": params[f"blocks_{j}"] for i, j in enumerate(kept)})
    return draft, config.replace(num_layers=layers)


def save(out: str | Path, config: ModelConfig, params, tokenizer, chat: tuple[str | None, dict[str, str]],
         *, overwrite: bool = False) -> SaveReport:
    """Writes the draft as a transformers directory `out` with the target's tokenizer and chat template
    (`chat`: the template's source or None, the named special tokens)."""
    out = Path(out)
    saved = hf.save_pretrained(out, config, params, tokenizer=tokenizer, overwrite=overwrite)
    template, specials = chat
    if specials:
        settings = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**specials, **settings}, indent=2) + "\n")
    if template is not None:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return saved
