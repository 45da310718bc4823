"""Loading released DeepSeek drafter checkpoints: synthetic safetensors with the reference names
(docs/METHOD.md §2.1, §3, §5.1) and tiny shapes, plus every error a bad checkpoint can raise."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from dspark_jax.drafters import api
from dspark_jax.drafters.compat import TargetId
from dspark_jax.drafters.hf import load_hf_drafter, load_hf_drafter_extras, save_hf_drafter
from dspark_jax.errors import CheckpointError
from dspark_jax.sched.sts import STS
from dspark_jax.testing import tiny_drafter_config, tiny_target_config

V, H, FF, NQ, NKV, D, R, M, LAYERS = 256, 64, 128, 4, 2, 16, 16, 3, 2


def _layer(prefix, d_in=H):
    """One Qwen3 decoder layer's tensors, HF layout ([out, in])."""
    return {
        f"{prefix}.input_layernorm.weight": (H,),
        f"{prefix}.post_attention_layernorm.weight": (H,),
        f"{prefix}.self_attn.q_proj.weight": (NQ * D, d_in),
        f"{prefix}.self_attn.k_proj.weight": (NKV * D, d_in),
        f"{prefix}.self_attn.v_proj.weight": (NKV * D, d_in),
        f"{prefix}.self_attn.o_proj.weight": (H, NQ * D),
        f"{prefix}.self_attn.q_norm.weight": (D,),
        f"{prefix}.self_attn.k_norm.weight": (D,),
        f"{prefix}.mlp.gate_proj.weight": (FF, H),
        f"{prefix}.mlp.up_proj.weight": (FF, H),
        f"{prefix}.mlp.down_proj.weight": (H, FF),
    }


def dspark_shapes(head="vanilla"):
    shapes = {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "fc.weight": (H, M * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "markov_head.markov_w1.weight": (V, R),
        "markov_head.markov_w2.weight": (V, R),
        "confidence_head.proj.weight": (1, H + R),
        "confidence_head.proj.bias": (1,),
    }
    if head == "gated":
        shapes.update(
            {"markov_head.gate_proj.weight": (R, H + R), "markov_head.gate_proj.bias": (R,)}
        )
    if head == "rnn":
        shapes.update(
            {
                "markov_head.joint_proj.weight": (3 * R, 2 * R + H),
                "markov_head.joint_proj.bias": (3 * R,),
            }
        )
    for i in range(LAYERS):
        shapes.update(_layer(f"layers.{i}"))
    return shapes


def eagle3_shapes():
    shapes = {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "fc.weight": (H, M * H),
        "norm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
    }
    shapes.update(_layer("layers.0", d_in=2 * H))
    return shapes


def hf_config(kind, head="vanilla", **over):
    """A drafter config.json as the reference writes it: the target's config, overridden."""
    d = {
        "architectures": ["Qwen3Eagle3Model" if kind == "eagle3" else "Qwen3DSparkModel"],
        "model_type": "qwen3",
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": FF,
        "num_attention_heads": NQ,
        "num_key_value_heads": NKV,
        "head_dim": D,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "num_target_layers": 4,
        "target_layer_ids": [0, 1, 2],
    }
    if kind == "eagle3":
        d.update(num_hidden_layers=1, ttt_length=4, step_loss_decay=0.8)
    else:
        d.update(
            num_hidden_layers=LAYERS,
            block_size=4,
            mask_token_id=V - 1,
            num_anchors=8,
            markov_rank=R if kind == "dspark" else 0,
            enable_confidence_head=kind == "dspark",
        )
        if kind == "dspark":
            d.update(markov_head_type=head, confidence_head_with_markov=True)
    d.update(over)
    return d


def write_ckpt(path, shapes, config, prefix="", seed=0):
    rng = np.random.default_rng(seed)
    tensors = {prefix + k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return {k[len(prefix) :]: v for k, v in tensors.items()}


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_load_released_dspark_layout(tmp_path, head):
    w = write_ckpt(tmp_path, dspark_shapes(head), hf_config("dspark", head))
    cfg, params = load_hf_drafter(tmp_path, tiny_target_config())
    assert cfg == tiny_drafter_config("dspark", markov_head_type=head)
    tr, fr = params.trainable, params.frozen
    np.testing.assert_array_equal(fr["embed_tokens"][...], w["embed_tokens.weight"])
    np.testing.assert_array_equal(fr["lm_head"][...], w["lm_head.weight"].T)
    np.testing.assert_array_equal(tr["fc"]["kernel"][...], w["fc.weight"].T)
    np.testing.assert_array_equal(tr["hidden_norm"]["weight"][...], w["hidden_norm.weight"])
    q = tr["layers"][1]["self_attn"]["q_proj"]["kernel"][...]
    np.testing.assert_array_equal(q, w["layers.1.self_attn.q_proj.weight"].T)
    mh = tr["markov_head"]
    np.testing.assert_array_equal(mh["markov_w1"][...], w["markov_head.markov_w1.weight"])
    np.testing.assert_array_equal(
        mh["markov_w2"]["kernel"][...], w["markov_head.markov_w2.weight"].T
    )
    proj = tr["confidence_head"]["proj"]
    np.testing.assert_array_equal(proj["kernel"][...], w["confidence_head.proj.weight"].T)
    np.testing.assert_array_equal(proj["bias"][...], w["confidence_head.proj.bias"])
    if head == "rnn":
        jp = mh["joint_proj"]["kernel"][...]
        np.testing.assert_array_equal(jp, w["markov_head.joint_proj.weight"].T)
    # the loaded model computes: the Markov bias of token t is W2 · W1[t]
    model = api.build(cfg, params)
    if head == "vanilla":
        _, bias, _ = model.markov_head.step(None, jnp.array([7]), jnp.zeros((1, H)))
        want = w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][7]
        np.testing.assert_allclose(bias[0], want, rtol=1e-4, atol=1e-4)


def test_load_dflash_and_eagle3_and_prefixed_names(tmp_path):
    shapes = {
        k: v for k, v in dspark_shapes().items() if "markov" not in k and "confidence" not in k
    }
    write_ckpt(tmp_path / "dflash", shapes, hf_config("dflash"), prefix="model.")
    cfg, params = load_hf_drafter(tmp_path / "dflash", tiny_target_config())
    assert cfg.kind == "dflash" and cfg.markov_rank == 0 and not cfg.confidence_head
    w = write_ckpt(tmp_path / "eagle3", eagle3_shapes(), hf_config("eagle3"))
    cfg, params = load_hf_drafter(tmp_path / "eagle3")  # target rebuilt from config.json
    assert cfg.kind == "eagle3" and cfg.block_size == 4 and cfg.target.num_layers == 4
    layer = params.trainable["layers"][0]
    np.testing.assert_array_equal(
        layer["hidden_norm"]["weight"][...], w["layers.0.hidden_norm.weight"]
    )
    assert layer["self_attn"]["k_proj"]["kernel"].shape == (2 * H, NKV * D)


def test_save_then_load_roundtrip(tmp_path):
    cfg = tiny_drafter_config("dspark", markov_head_type="gated")
    params = api.init_params(cfg, seed=4)
    save_hf_drafter(cfg, params, tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3DSparkModel"]
    cfg2, params2 = load_hf_drafter(tmp_path, cfg.target)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)


def test_temperatures_and_target_roundtrip_and_another_target_fails(tmp_path):
    cfg = tiny_drafter_config("dspark")
    params = api.init_params(cfg, seed=1)
    sts = STS((0.5, 1.25, 2.0, 3.5))
    tid = TargetId.of(cfg.target, name="tiny", vocab_hash="0123456789abcdef")
    save_hf_drafter(cfg, params, tmp_path / "a")
    assert load_hf_drafter_extras(tmp_path / "a") == (None, None)  # a released layout
    save_hf_drafter(cfg, params, tmp_path / "b", sts=sts, trained_for=tid.to_json())
    with open(tmp_path / "b" / "config.json") as f:
        d = json.load(f)
    with open(tmp_path / "a" / "config.json") as f:  # the released keys are unchanged
        assert {
            k: v for k, v in d.items() if k not in ("confidence_temperatures", "trained_for")
        } == json.load(f)
    assert load_hf_drafter_extras(tmp_path / "b") == (sts, tid)
    cfg2, params2 = load_hf_drafter(tmp_path / "b", cfg.target)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
    # recorded for a 6-layer target whose features are layers (1, 4): refused on this one
    other = TargetId.of(tiny_target_config(num_layers=6, target_layer_ids=(1, 4)))
    save_hf_drafter(cfg, params, tmp_path / "c", trained_for=other)
    with pytest.raises(CheckpointError, match="incompatible with the target.*6-layer target"):
        load_hf_drafter(tmp_path / "c", cfg.target)
    d["confidence_temperatures"] = [1.0, -2.0]
    (tmp_path / "b" / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="confidence_temperatures"):
        load_hf_drafter_extras(tmp_path / "b")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s, c: s.pop("markov_head.markov_w2.weight"), "missing tensors.*markov_w2"),
        (lambda s, c: s.update({"markov_head.gate_proj.weight": (R, H + R)}), "unexpected tensors"),
        (lambda s, c: s.update({"fc.weight": (H, 2 * H)}), r"shape mismatch for fc.weight"),
        (lambda s, c: s.update({"layers.2.norm.weight": (H,)}), "unexpected tensors.*layers.2"),
        (lambda s, c: c.update(hidden_size=32), "incompatible with the target.*hidden_size"),
        (lambda s, c: c.update(target_layer_ids=[0, 1]), "reads target layers"),
        (lambda s, c: c.update(mask_token_id=V), "mask_token_id"),
        (
            lambda s, c: (c.update(architectures=["Qwen3ForCausalLM"]), c.pop("block_size")),
            "not a DSpark",
        ),
        (lambda s, c: c.update(num_target_layers=36), "36-layer target"),
    ],
)
def test_bad_checkpoints_raise_clear_errors(tmp_path, mutate, match):
    shapes, config = dspark_shapes(), hf_config("dspark")
    mutate(shapes, config)
    write_ckpt(tmp_path, shapes, config)
    with pytest.raises(CheckpointError, match=match):
        load_hf_drafter(tmp_path, tiny_target_config())


def test_missing_files_and_unknown_target(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_drafter(tmp_path / "nope", tiny_target_config())
    config = hf_config("dspark")
    del config["num_target_layers"]
    write_ckpt(tmp_path, dspark_shapes(), config)
    with pytest.raises(CheckpointError, match="pass target="):
        load_hf_drafter(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing files"):
        load_hf_drafter(tmp_path, tiny_target_config())


def _torch_dspark_block(w, feats, ids, a, g, mask_id, theta=1e6, eps=1e-6):
    """A from-scratch PyTorch DSpark block (docs/METHOD.md §2.2–2.4, §3.1, §3.5) for one anchor:
    HF weight layout, "rotate half" RoPE, GQA by repeat_interleave."""
    import torch

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    t = {k: torch.tensor(v) for k, v in w.items()}

    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, heads, d]
        inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
        f = pos[:, None].float() * inv
        emb = torch.cat([f, f], -1)
        return x * emb.cos()[:, None] + rotate_half(x) * emb.sin()[:, None]

    ctx = rms(torch.tensor(feats[:a]) @ t["fc.weight"].T, t["hidden_norm.weight"])  # [a, H]
    block = torch.tensor([int(ids[a])] + [mask_id] * (g - 1))
    h = t["embed_tokens.weight"][block]
    pos_blk, pos_all = torch.arange(a, a + g), torch.arange(a + g)
    for i in range(LAYERS):
        p = f"layers.{i}."
        u = rms(h, t[p + "input_layernorm.weight"])
        q = (u @ t[p + "self_attn.q_proj.weight"].T).view(g, NQ, D)
        q = rope(rms(q, t[p + "self_attn.q_norm.weight"]), pos_blk)
        both = torch.cat([ctx, u])
        k = (both @ t[p + "self_attn.k_proj.weight"].T).view(a + g, NKV, D)
        k = rope(rms(k, t[p + "self_attn.k_norm.weight"]), pos_all)
        v = (both @ t[p + "self_attn.v_proj.weight"].T).view(a + g, NKV, D)
        k, v = k.repeat_interleave(NQ // NKV, 1), v.repeat_interleave(NQ // NKV, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / D**0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(g, NQ * D)
        h = h + o @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    z = rms(h, t["norm.weight"])
    prev = torch.tensor([int(x) for x in ids[a : a + g]])  # teacher forcing: x_a, x_{a+1}, ...
    e = t["markov_head.markov_w1.weight"][prev]
    logits = z @ t["lm_head.weight"].T + e @ t["markov_head.markov_w2.weight"].T
    conf = (
        torch.cat([z, e], -1) @ t["confidence_head.proj.weight"].T + t["confidence_head.proj.bias"]
    )
    return logits.numpy(), conf[:, 0].numpy()


def test_loaded_dspark_matches_a_pytorch_reference(tmp_path):
    from dspark_jax.drafters.dspark import teacher_forced
    from dspark_jax.train.anchors import make_blocks

    rng = np.random.default_rng(5)
    w = {
        k: (
            1.0 + 0.1 * rng.normal(size=s)
            if k.endswith("norm.weight")
            else 0.1 * rng.normal(size=s)
        ).astype(np.float32)
        for k, s in dspark_shapes().items()
    }
    save_file(w, os.path.join(tmp_path, "model.safetensors"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf_config("dspark"), f)
    cfg, params = load_hf_drafter(tmp_path, tiny_target_config())
    seq, a, g = 14, 9, cfg.block_size
    feats = rng.normal(size=(seq, M * H)).astype(np.float32)
    ids = rng.integers(0, V - 1, seq)
    want_logits, want_conf = _torch_dspark_block(w, feats, ids, a, g, cfg.mask_token_id)

    model = api.build(cfg, params)
    blk = make_blocks(
        ids[None], np.ones((1, seq)), jnp.array([[a]]), jnp.array([[True]]), g, cfg.mask_token_id
    )
    kv = model.context_kv(jnp.asarray(feats)[None], jnp.arange(seq)[None])
    z = model.blocks(kv, blk.anchors, blk.keep, blk.block_ids, blk.positions)
    out = teacher_forced(model, z, blk.prev_ids)
    np.testing.assert_allclose(out.logits[0, 0], want_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.conf_logits[0, 0], want_conf, rtol=1e-4, atol=1e-4)
