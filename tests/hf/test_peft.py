"""PEFT's LoRA adapter files (`jaxattn.hf.peft`) against PEFT itself, on tiny transformers models.

Each base is a seeded float32 transformers model (every parameter redrawn), saved with
`save_pretrained` and loaded with `jaxattn.hf.load_pretrained`; own jaxattn models go the other way
(`jaxattn.hf.save_pretrained`, then transformers). Adapters carry random non-zero lora_B. Compared in
float32 (max |logit difference| <= 1e-4): an adapter jaxattn wrote, loaded by
`peft.PeftModel.from_pretrained`; one PEFT wrote, loaded by `load_adapter`; and three AdamW steps
from the same adapter on the same batches, whose losses must agree.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
torch = pytest.importorskip("torch")  # the test extra
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file, save_file

import jaxattn
from jaxattn import hf
from jaxattn.hf import UnsupportedCheckpoint, InvalidCheckpoint
from jaxattn.hf.peft import load_adapter, save_adapter
from jaxattn.lora import LoraConfig, add_lora, combine_lora, split_lora
from jaxattn.layers.moe import MoEConfig
from tiny_models import drawn_params, tiny_config, with_random_b

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)
VOCAB, SEQ, TOL = 64, 12, 1e-4
ALL = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {"llama": ("LlamaConfig", SMALL), "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16))}


def tokens(seed=0, batch=2):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ))


def randomize_(model, seed=0, std=0.1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * std
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def jax_logits(config, params, ids):
    return np.asarray(jaxattn.DecoderLM(config).apply({"params": params}, jnp.asarray(ids)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name -> (transformers model, its directory, jaxattn config, params): HF families and own models."""
    cache = {}

    def get(name):
        if name in cache:
            return cache[name]
        path = tmp_path_factory.mktemp(name)
        if name in FAMILIES:
            kind, kwargs = FAMILIES[name]
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**kwargs),
                                                                  attn_implementation="eager")
            randomize_(model)
            model.eval().save_pretrained(path)
            config, params = hf.load_pretrained(path)
        else:  # own models: interleaved RoPE and fused qkv (exported to Llama), and GPT-2's Conv1D
            config = OWN[name]
            params = drawn_params(config, seed=1, std=0.1)
            hf.save_pretrained(path, config, params)
            model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        cache[name] = model, path, config, params
        return cache[name]
    return get


OWN = {
    "own_llama_interleaved_fused": tiny_config("gqa", positions="rope", mlp="swiglu", norm="rmsnorm", vocab_size=VOCAB,
                                               rope_interleaved=True, fused_qkv=True, d_model=32, max_seq_len=SEQ),
    "own_gpt2": tiny_config("mha", positions="learned", norm="layernorm", mlp="gelu", use_bias=True,
                            vocab_size=VOCAB, d_model=32, max_seq_len=SEQ),
}
EXPORTS = {"llama": ALL, "qwen3": ALL, "own_llama_interleaved_fused": ("q", "k", "o", "gate", "down"),
           "own_gpt2": ("o", "up", "down")}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_an_adapter_jaxattn_wrote_loads_in_peft(bases, tmp_path, name):
    model, _, config, params = bases(name)
    lora = LoraConfig(rank=4, alpha=8.0, targets=EXPORTS[name])
    with_lora = with_random_b(add_lora(params, config, lora, jax.random.PRNGKey(1)), std=0.1)
    save_adapter(tmp_path, config, with_lora, lora, base_model_name_or_path="tiny")
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8 and written["peft_type"] == "LORA"
    assert written["fan_in_fan_out"] == (name == "own_gpt2")
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(model), tmp_path).eval()
    ids = tokens()
    expected = jax_logits(config, with_lora, ids)
    assert np.max(np.abs(torch_logits(adapted, ids) - expected)) < TOL
    assert np.max(np.abs(torch_logits(model, ids) - expected)) > 1e-2  # the adapter is visible
    back, back_lora = load_adapter(tmp_path, config, params)  # and back: the same adapters
    assert back_lora == lora and np.max(np.abs(jax_logits(config, back, ids) - expected)) < 1e-6


def peft_adapter(model, directory, *, rslora=False, seed=0):
    """A PEFT LoRA (r=4, alpha=8) on every projection of a copy of `model`, lora_B redrawn; saved to `directory`."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_MODULES, use_rslora=rslora, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(copy.deepcopy(model), config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    adapted.save_pretrained(directory)
    return adapted


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_adapter_peft_wrote_loads_in_jaxattn(bases, tmp_path, name):
    model, _, config, params = bases(name)
    adapted = peft_adapter(model, tmp_path).eval()
    with_lora, lora = load_adapter(tmp_path, config, params)
    assert lora == LoraConfig(rank=4, alpha=8.0, targets=ALL)
    ids = tokens(1)
    assert np.max(np.abs(torch_logits(adapted, ids) - jax_logits(config, with_lora, ids))) < TOL


@functools.partial(jax.jit, static_argnums=0)  # one compile per config: faster than op by op for 4 steps
def loss_and_grads(config, adapters, frozen, ids):
    """Mean next-token cross-entropy (what transformers' `labels=ids` computes) and its gradient wrt the adapters."""
    def loss_of(ad):
        out = jaxattn.DecoderLM(config).apply({"params": combine_lora(frozen, ad)}, ids)[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), ids[:, 1:, None], -1))
    return jax.value_and_grad(loss_of)(adapters)


@pytest.mark.parametrize("name, rslora", [("llama", False), ("qwen3", False), ("llama", True)])
def test_three_adamw_steps_give_peft_s_losses(bases, tmp_path, name, rslora):
    model, _, config, params = bases(name)
    adapted = peft_adapter(model, tmp_path, rslora=rslora, seed=2)
    with_lora, lora = load_adapter(tmp_path, config, params)
    assert lora.rslora == rslora
    batches = [tokens(10 + step) for step in range(3)]
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01

    trainable = [p for p in adapted.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in adapted.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    torch_losses = []
    for ids in batches:
        loss = adapted(input_ids=torch.as_tensor(ids), labels=torch.as_tensor(ids)).loss
        torch_losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    adapters, frozen = split_lora(with_lora)
    initial = adapters
    tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = tx.init(adapters)
    jax_losses = []
    for ids in batches:
        loss, grads = loss_and_grads(config, adapters, frozen, jnp.asarray(ids))
        jax_losses.append(float(loss))
        updates, state = tx.update(grads, state, adapters)
        adapters = optax.apply_updates(adapters, updates)
    np.testing.assert_allclose(jax_losses, torch_losses, atol=1e-4, rtol=0)
    moved = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), adapters, initial)
    assert min(jax.tree.leaves(moved)) > 1e-4  # every adapter took the steps


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def written(bases, tmp_path_factory):
    """An adapter jaxattn wrote for the Llama base (q and v only)."""
    _, _, config, params = bases("llama")
    lora = LoraConfig(rank=2, targets=("q", "v"))
    directory = tmp_path_factory.mktemp("written")
    save_adapter(directory, config, with_random_b(add_lora(params, config, lora, jax.random.PRNGKey(0)), std=0.1), lora)
    return directory


def _edited(written, to, **changes):
    shutil.copytree(written, to, dirs_exist_ok=True)
    hf_config = json.loads((to / "adapter_config.json").read_text()) | changes
    (to / "adapter_config.json").write_text(json.dumps(hf_config))
    return to


@pytest.mark.parametrize("changes, match", [
    (dict(peft_type="IA3"), "peft_type='IA3' is not supported"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern=.*a rank per module"),
    (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern="),
    (dict(use_dora=True), "use_dora=True .*DoRA"),
    (dict(bias="all"), "bias='all'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save="),
    (dict(layers_to_transform=[0]), "layers_to_transform=\\[0\\]"),
    (dict(target_modules=["foo_proj"]), "target module 'foo_proj' is not in the LlamaForCausalLM layout"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head is not a LoRA target jaxattn represents"),
    (dict(target_modules=["q_proj", "model.layers.0.self_attn.v_proj"]), "not module model.layers.1.self_attn.v_proj"),
])
def test_adapters_jaxattn_cannot_represent_are_refused_by_key(bases, written, tmp_path, changes, match):
    _, _, config, params = bases("llama")
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_adapter(_edited(written, tmp_path, **changes), config, params)


def test_wrong_missing_or_extra_tensors_name_the_tensor(bases, written, tmp_path):
    _, _, config, params = bases("llama")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    for edit, match in ((lambda t: t.update({key: np.zeros((3, 2), np.float32)}),
                         r"expected shape \(16, 2\), found \(3, 2\)"),
                        (lambda t: t.pop(key), "is missing"),
                        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((2, 32), np.float32)}),
                         "lm_head.lora_A.weight: is not an adapter")):
        directory = _edited(written, tmp_path / str(len(match)))
        tensors = load_file(directory / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, directory / "adapter_model.safetensors")
        with pytest.raises(InvalidCheckpoint, match=match):
            load_adapter(directory, config, params)


def test_save_refuses_to_overwrite_and_what_peft_cannot_hold(bases, written, tmp_path):
    _, _, config, params = bases("llama")
    lora = LoraConfig(rank=2, targets=("q", "v"))
    with_lora = add_lora(params, config, lora, jax.random.PRNGKey(0))
    with pytest.raises(FileExistsError, match="adapter_config.json exists; pass overwrite=True"):
        save_adapter(written, config, with_lora, lora)
    save_adapter(written, config, with_lora, lora, overwrite=True)
    with pytest.raises(ValueError, match="differ from lora_config's rank 3"):
        save_adapter(tmp_path / "rank", config, with_lora, LoraConfig(rank=3, targets=("q", "v")))
    with pytest.raises(ValueError, match="no LoraWeight"):
        save_adapter(tmp_path / "none", config, params, lora)

    gpt2 = OWN["own_gpt2"]  # GPT-2's c_attn holds q, k and v in one tensor
    gpt2_params = drawn_params(gpt2)
    with pytest.raises(UnsupportedCheckpoint, match=r"attn.c_attn: one tensor holds the parts \['k', 'q', 'v'\]"):
        save_adapter(tmp_path / "gpt2", gpt2, add_lora(gpt2_params, gpt2, LoraConfig(targets=("q",)),
                                                        jax.random.PRNGKey(0)), LoraConfig(targets=("q",)))
    mixtral = tiny_config("gqa", positions="rope", mlp="swiglu", norm="rmsnorm", norm_eps=1e-6,
                          moe=MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, norm_topk_prob=True))
    moe_params = drawn_params(mixtral)
    experts = LoraConfig(targets=("q", "experts"))
    with pytest.raises(UnsupportedCheckpoint, match="MixtralForCausalLM module .*experts.*routed experts: PEFT 0.21"):
        save_adapter(tmp_path / "moe", mixtral, add_lora(moe_params, mixtral, experts, jax.random.PRNGKey(0)), experts)
    assert not (tmp_path / "moe").exists() and not (tmp_path / "gpt2").exists()
