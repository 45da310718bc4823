"""The reference's Gemma 4 drafter checkpoint format (issue 41 item 4; docs/METHOD.md §2.10,
§5.1, §8): config.json is a copy of the target's *text* config (every layer full attention, the
drafter's layer count, untied) plus the DSpark / Eagle3 fields; tensor names are the HF Gemma 4
decoder layers' module paths (no v_proj when K = V, the `layer_scalar` buffer) plus fc,
hidden_norm, norm, embed_tokens, lm_head and the heads.

Files written by hand in that format load into the drafter they were made from; save -> load is
bit-exact; a PyTorch `Gemma4TextModel` built from our config.json has exactly our layers' tensor
names and shapes (and loads them strictly); malformed checkpoints fail with one line.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from dspark_jax.drafters import api
from dspark_jax.drafters.dspark import teacher_forced
from dspark_jax.drafters.eagle3 import ttt_hidden
from dspark_jax.drafters.hf import drafter_config_from_hf, load_hf_drafter, save_hf_drafter
from dspark_jax.errors import CheckpointError
from dspark_jax.models.hf_config import gemma4_text_config_dict
from dspark_jax.models.hf_gemma4 import gemma4_config
from dspark_jax.testing import tiny_target_config
from dspark_jax.train.anchors import make_blocks
from tests.test_gemma4_drafters import TCFG, drafter
from tests.test_gemma4_engine import WINDOW, V, gemma_config

# a target the reference supports: no experts, per-layer inputs or KV-shared layers (§2.10)
PLAIN = gemma_config(
    tie=False, num_kv_shared_layers=0, use_double_wide_mlp=False, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=262_144, num_experts=0, top_k_experts=0, moe_intermediate_size=0,
)  # fmt: skip
LAYERS = 2  # DSpark / DFlash draft layers (`drafter`)
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
HEADS = ("fc.", "hidden_norm.", "lm_head.", "markov_head.", "confidence_head.")


def text_config(n_layers: int) -> dict:
    """PLAIN's HF Gemma4TextConfig as transformers writes it (extra keys included), every layer
    full attention, `n_layers` of them, untied: the copy the reference's drafters carry."""
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "transformers_version": "5.5.0", "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "initializer_range": 0.02, "use_cache": True,
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": n_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {
                "rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e5
            },
        },
        "attention_bias": False, "attention_dropout": 0.0, "sliding_window": WINDOW,
        "layer_types": ["full_attention"] * n_layers, "final_logit_softcapping": 10.0,
        "use_bidirectional_attention": None, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 262_144, "enable_moe_block": False, "num_experts": None,
        "top_k_experts": None, "moe_intermediate_size": None, "dtype": "float32",
    }  # fmt: skip


def reference_config(kind: str) -> dict:
    """The drafter config.json of the reference: the text config and the drafter's fields."""
    d = text_config(1 if kind == "eagle3" else LAYERS)
    d.update(num_target_layers=6, target_layer_ids=[0, 2, 4])
    if kind == "eagle3":
        d.update(architectures=["Gemma4Eagle3Model"], ttt_length=3, step_loss_decay=0.8)
    else:
        d.update(
            architectures=["Gemma4DSparkModel"], block_size=3, mask_token_id=V - 1,
            num_anchors=6, markov_rank=8 if kind == "dspark" else 0,
            enable_confidence_head=kind == "dspark",
        )  # fmt: skip
        if kind == "dspark":
            d.update(markov_head_type="vanilla", confidence_head_with_markov=True)
    return d


def reference_tensors(kind: str, params) -> dict[str, np.ndarray]:
    """The drafter's tensors under the reference's names, written out by hand ([out, in])."""
    tr, fr = params.trainable, params.frozen

    def a(x):
        return np.asarray(x[...])

    def t(x):
        return np.ascontiguousarray(a(x).T)

    out = {
        "embed_tokens.weight": a(fr["embed_tokens"]),
        "lm_head.weight": t(fr["lm_head"]),
        "fc.weight": t(tr["fc"]["kernel"]),
        "norm.weight": a(tr["norm"]["weight"]),
    }
    for i, layer in tr["layers"].items():
        p, attn, mlp = f"layers.{i}.", layer["self_attn"], layer["mlp"]
        for n in ("q_proj", "k_proj", "o_proj"):  # K = V: no v_proj
            out[f"{p}self_attn.{n}.weight"] = t(attn[n]["kernel"])
        for n in ("q_norm", "k_norm"):
            out[f"{p}self_attn.{n}.weight"] = a(attn[n]["weight"])
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{n}.weight"] = t(mlp[n]["kernel"])
        for n in LAYER_NORMS:
            out[f"{p}{n}.weight"] = a(layer[n]["weight"])
        out[f"{p}layer_scalar"] = a(layer["layer_scalar"])
    if kind == "eagle3":
        out["layers.0.hidden_norm.weight"] = a(tr["layers"][0]["hidden_norm"]["weight"])
    else:
        out["hidden_norm.weight"] = a(tr["hidden_norm"]["weight"])
    if kind == "dspark":
        mh, proj = tr["markov_head"], tr["confidence_head"]["proj"]
        out["markov_head.markov_w1.weight"] = a(mh["markov_w1"])
        out["markov_head.markov_w2.weight"] = t(mh["markov_w2"]["kernel"])
        out["confidence_head.proj.weight"] = t(proj["kernel"])
        out["confidence_head.proj.bias"] = a(proj["bias"])
    return out


def random_drafter(kind: str, target=PLAIN, seed=0, **kw):
    """A drafter config and params with every tensor random (norms and layer scalars too)."""
    cfg = drafter(kind, target, **kw)
    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: api.init_params(cfg))  # filled without compiling
    return cfg, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), abstract)


def outputs(cfg, params) -> list[np.ndarray]:
    """Draft logits (and confidence logits) of one block / the training-time test on random
    features: what a loaded drafter must reproduce."""
    model = api.build(cfg, params)
    rng = np.random.default_rng(7)
    seq, g = 14, cfg.block_size
    feats = jnp.asarray(rng.normal(size=(1, seq, cfg.feature_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, V - 1, (1, seq)))
    if cfg.kind == "eagle3":
        steps = ttt_hidden(model, feats, ids, jnp.array([seq]))
        return [np.asarray(model.logits(steps))]
    blk = make_blocks(ids, jnp.ones((1, seq)), jnp.array([[9]]), jnp.array([[True]]), g,
                      cfg.mask_token_id)  # fmt: skip
    kv = model.context_kv(feats, jnp.arange(seq)[None])
    z = model.blocks(kv, blk.anchors, blk.keep, blk.block_ids, blk.positions)
    out = teacher_forced(model, z, blk.prev_ids)
    conf = [] if out.conf_logits is None else [np.asarray(out.conf_logits)]
    return [np.asarray(out.logits), *conf]


def write(path, tensors, config):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def assert_same_params(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_reference_layout_loads_and_computes_the_same(tmp_path, kind):
    """Hand-written files in the reference's format load into exactly the drafter they came
    from (with the target given, or rebuilt from config.json), which computes the same draft
    logits; our export writes the same config keys and the same tensor names."""
    cfg, params = random_drafter(kind)
    tensors, config = reference_tensors(kind, params), reference_config(kind)
    write(tmp_path / "ref", tensors, config)
    cfg2, params2 = load_hf_drafter(tmp_path / "ref", PLAIN)
    assert cfg2 == cfg
    assert_same_params(params, params2)
    want = outputs(cfg, params)
    for got, w in zip(outputs(cfg2, params2), want, strict=True):
        np.testing.assert_array_equal(got, w)
    cfg3, params3 = load_hf_drafter(tmp_path / "ref")  # target rebuilt from config.json
    assert cfg3.layer_config == cfg.layer_config and cfg3.target.num_layers == 6
    for got, w in zip(outputs(cfg3, params3), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    save_hf_drafter(cfg, params, tmp_path / "ours")
    with open(tmp_path / "ours" / "config.json") as f:
        ours = json.load(f)
    assert ours == {k: config[k] for k in ours}
    assert set(load_file(tmp_path / "ours" / "model.safetensors")) == set(tensors)


def test_per_layer_config_form_loads(tmp_path):
    """transformers >= 5.25 writes the global geometry as `per_layer_config` (one entry per
    full-attention layer) instead of global_head_dim / num_global_key_value_heads."""
    cfg, params = random_drafter("dflash")
    config = reference_config("dflash")
    del config["global_head_dim"], config["num_global_key_value_heads"]
    over = {"head_dim": 32, "num_key_value_heads": 1}
    config["per_layer_config"] = {str(i): over for i in range(LAYERS)}
    write(tmp_path, reference_tensors("dflash", params), config)
    assert load_hf_drafter(tmp_path, PLAIN)[0] == cfg
    assert load_hf_drafter(tmp_path)[0].layer_config == cfg.layer_config


@pytest.mark.parametrize(
    "kind,kw",
    [("dspark", dict(markov_head_type="rnn")), ("dflash", {}), ("eagle3", {})],
)
def test_save_load_roundtrip_is_bit_exact(tmp_path, kind, kw):
    """On the full-featured tiny target (experts, per-layer inputs, KV-shared layers), in fp32
    and bf16: config.json describes the draft layers (full attention, none of those)."""
    for dtype in ("float32", "bfloat16"):
        cfg, params = random_drafter(kind, TCFG, dtype=dtype, **kw)
        save_hf_drafter(cfg, params, tmp_path / dtype)
        cfg2, params2 = load_hf_drafter(tmp_path / dtype, TCFG, dtype=dtype)
        assert cfg2 == cfg
        assert_same_params(params, params2)
    with open(tmp_path / "float32" / "config.json") as f:
        d = json.load(f)
    n = cfg.num_layers
    assert d["layer_types"] == ["full_attention"] * n and d["num_hidden_layers"] == n
    assert (d["num_kv_shared_layers"], d["enable_moe_block"]) == (0, False)
    assert d["hidden_size_per_layer_input"] == 0 and d["tie_word_embeddings"] is False
    names = load_file(tmp_path / "float32" / "model.safetensors")
    assert "layers.0.layer_scalar" in names and "layers.0.self_attn.v_proj.weight" not in names


def test_text_config_roundtrip():
    """`gemma4_text_config_dict` is the inverse of `gemma4_config` (HF Gemma4TextConfig keys)."""
    for cfg in (
        TCFG,
        PLAIN,
        gemma_config(k_eq_v=False, global_kv_heads=1),  # per_layer_config
        gemma_config(global_rope_fraction=1.0, final_logit_softcapping=None),
    ):
        assert gemma4_config(gemma4_text_config_dict(cfg), cfg.target_layer_ids, cfg.dtype) == cfg


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_names_and_shapes_are_hf_gemma4_module_paths(tmp_path, kind):
    """transformers' own `Gemma4TextModel`, built from our exported config.json, has exactly our
    decoder tensors (embed_tokens, layers.*, norm) and loads them strictly (Eagle3's layer reads
    2H-wide inputs: the names agree, its q/k shapes are Eagle3's own)."""
    torch = pytest.importorskip("torch")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel

    cfg, params = random_drafter(kind)
    save_hf_drafter(cfg, params, tmp_path)
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    tensors = load_file(tmp_path / "model.safetensors")
    ours = {n: t for n, t in tensors.items() if not n.startswith(HEADS)}
    ours.pop("layers.0.hidden_norm.weight", None)  # Eagle3's, beside its layer
    drafter_keys = ("architectures", "num_target_layers", "target_layer_ids")
    torch.manual_seed(0)
    hf = Gemma4TextModel(Gemma4TextConfig(**{k: v for k, v in d.items() if k not in drafter_keys}))
    theirs = {n: tuple(t.shape) for n, t in hf.state_dict().items()}
    assert set(theirs) == set(ours)
    if kind == "eagle3":
        return
    assert theirs == {n: t.shape for n, t in ours.items()}
    hf.load_state_dict({n: torch.from_numpy(t) for n, t in ours.items()}, strict=True)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda t, c: t.pop("layers.1.self_attn.k_proj.weight"),
         r"missing tensors.*layers\.1\.self_attn\.k_proj"),
        (lambda t, c: t.update({"layers.0.self_attn.v_proj.weight": np.zeros((32, 64))}),
         r"unexpected tensors.*v_proj"),
        (lambda t, c: t.update({"layers.0.self_attn.q_norm.weight": np.ones(16)}),
         r"shape mismatch for layers\.0\.self_attn\.q_norm\.weight"),
        (lambda t, c: t.update({"layers.0.layer_scalar": np.ones(())}),
         r"shape mismatch for layers\.0\.layer_scalar"),
        (lambda t, c: c.update(final_logit_softcapping=30.0),
         r"differ from the target's.*final_logit_softcapping 30\.0 vs 10\.0"),
        (lambda t, c: c.update(attention_k_eq_v=False),
         r"differ from the target's.*k_eq_v False vs True"),
        (lambda t, c: c.update(global_head_dim=16), r"global_head_dim 16 vs 32"),
        (lambda t, c: c.update(hidden_activation="gelu"), r"unsupported Gemma 4 hidden_act"),
    ],
)  # fmt: skip
def test_malformed_checkpoints_fail_with_one_line(tmp_path, mutate, match):
    """Every check runs on config.json and the headers; the error is one line naming it."""
    _, params = random_drafter("dspark")
    tensors, config = reference_tensors("dspark", params), reference_config("dspark")
    mutate(tensors, config)
    write(tmp_path, {k: np.asarray(v, np.float32) for k, v in tensors.items()}, config)
    with pytest.raises(CheckpointError, match=match) as e:
        load_hf_drafter(tmp_path, PLAIN)
    assert "\n" not in str(e.value)


def test_gemma4_drafter_for_another_architecture_is_refused():
    with pytest.raises(CheckpointError, match="Gemma 4 drafter's but the target is qwen3"):
        drafter_config_from_hf(reference_config("dflash"), tiny_target_config())
