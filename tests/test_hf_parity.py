"""Our target vs transformers' PyTorch Qwen3 / Qwen2 / Llama on the same tiny random checkpoints.

Each model is built from a tiny random config with randomized norm weights and biases (so a
missing bias, an untransposed kernel or a wrong RoPE cannot pass), saved with `save_pretrained`
and loaded with `load_target`. Also: sharded checkpoints, bf16, saving ours back as HF, and every
bad input `load_target` / `load_tokenizer` / `check_request_fits` must refuse.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dspark_jax.config import MeshConfig  # noqa: E402
from dspark_jax.errors import CheckpointError, RequestError  # noqa: E402
from dspark_jax.models.hf import check_checkpoint, load_target, load_tokenizer, save_target_hf  # noqa: E402
from dspark_jax.models.transformer import forward_jit, init_cache  # noqa: E402
from dspark_jax.models.validate import check_request_fits  # noqa: E402
from dspark_jax.testing import positions_like, random_params, tiny_target_config  # noqa: E402

ARCHS = ("qwen3", "qwen2", "llama")
_HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
LAYER_IDS = (0, 1, 2)
B, T, V = 2, 24, 256
TOL = 1e-4

_COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
)


def _hf_model(arch: str, seed: int):
    if arch == "qwen3":
        cls, cfg_cls = transformers.Qwen3ForCausalLM, transformers.Qwen3Config
        kw = dict(
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    elif arch == "qwen2":
        cls, cfg_cls = transformers.Qwen2ForCausalLM, transformers.Qwen2Config
        kw = dict(
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
        )
    else:
        cls, cfg_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
        rope = dict(
            rope_type="llama3",
            rope_theta=1e4,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,  # < T, so the scaled bands matter
        )
        kw = dict(tie_word_embeddings=False, rope_parameters=rope)
    torch.manual_seed(seed)
    model = cls(cfg_cls(**_COMMON, **kw, attn_implementation="eager")).eval()
    _randomize_norms_and_biases(model)
    return model


def _randomize_norms_and_biases(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)


def _hf_run(model, ids):
    """(logits, hidden_states tuple, final-normed last hidden) as numpy, fp32."""
    with torch.no_grad():
        t = torch.tensor(np.asarray(ids), dtype=torch.long)
        out = model(t, output_hidden_states=True)
        last = model.model(t).last_hidden_state
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states], last.numpy()


def _fwd(cfg, params, tokens, positions, cache=None):
    return forward_jit(cfg, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions), cache)


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """arch -> (torch model, checkpoint dir)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, arch in enumerate(ARCHS):
        model = _hf_model(arch, seed=i)
        d = root / arch
        model.save_pretrained(d)
        out[arch] = (model, str(d))
    return out


@pytest.fixture(scope="module")
def seqs():
    rng = np.random.default_rng(0)
    a = rng.integers(0, V, (B, T))
    return a, rng.integers(0, V, (B, T))


@pytest.mark.parametrize("arch", ARCHS)
def test_full_sequence_parity(arch, ckpts, seqs):
    model, path = ckpts[arch]
    cfg, params = load_target(path, target_layer_ids=LAYER_IDS)
    assert cfg.architecture == arch and cfg.dtype == "float32"
    assert cfg.tie_word_embeddings == (arch != "llama")
    assert cfg.qkv_bias == (arch == "qwen2") and (cfg.rope_scaling is not None) == (arch == "llama")
    tokens, _ = seqs
    ref_logits, ref_hs, ref_last = _hf_run(model, tokens)
    out, _ = _fwd(cfg, params, tokens, positions_like(jnp.asarray(tokens)))
    d = _maxdiff(out.logits, ref_logits)
    print(f"{arch}: max |dlogit| = {d:.2e} (logit scale {np.abs(ref_logits).max():.2f})")
    assert d <= TOL
    assert np.abs(ref_logits).max() > 0.5  # the comparison is not between near-zero numbers
    # Features: raw layer outputs == HF hidden_states[l + 1], concatenated in id order.
    ref_feats = np.concatenate([ref_hs[i + 1] for i in LAYER_IDS], axis=-1)
    assert out.features.shape == (B, T, len(LAYER_IDS) * cfg.hidden_size)
    assert _maxdiff(out.features, ref_feats) <= TOL
    # Final-normed last hidden == HF base model's last_hidden_state (== hidden_states[-1]).
    assert _maxdiff(out.hidden, ref_last) <= TOL
    # The final layer's raw output differs from the normed one: this check can fail.
    assert _maxdiff(ref_hs[-2], ref_last) > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_path_parity(arch, ckpts, seqs):
    """prefill, 3 one-token steps, a 5-token verify chunk, per-row rollback, re-verify.

    Prefill, verify and re-verify all take 5 tokens so they share one compiled shape.
    """
    model, path = ckpts[arch]
    cfg, params = load_target(path, target_layer_ids=LAYER_IDS)
    a, fresh = seqs
    ref_a, hs_a, _ = _hf_run(model, a)
    full_a, _ = _fwd(cfg, params, a, positions_like(jnp.asarray(a)))

    cache = init_cache(cfg, B, 32)
    got_logits, got_feats = [], []

    def step(cache, start, n):
        tok = a[:, start : start + n]
        out, cache = _fwd(cfg, params, tok, positions_like(jnp.asarray(tok), start), cache)
        got_logits.append(np.asarray(out.logits))
        got_feats.append(np.asarray(out.features))
        return cache.with_lengths(np.full((B,), start + n)), start + n

    cache, pos = step(cache, 0, 5)  # prefill
    for _ in range(3):
        cache, pos = step(cache, pos, 1)  # decode
    cache, pos = step(cache, pos, 5)  # verify chunk, positions 8..12
    logits = np.concatenate(got_logits, axis=1)
    feats = np.concatenate(got_feats, axis=1)
    assert _maxdiff(logits, ref_a[:, :pos]) <= TOL
    assert _maxdiff(logits, full_a.logits[:, :pos]) <= TOL
    assert _maxdiff(feats, full_a.features[:, :pos]) <= TOL

    # Rollback: row 0 keeps 6 tokens (stale K/V at 6..12 stay in the cache, 11..12 beyond the
    # re-verified chunk), row 1 keeps 10.
    keep = np.array([6, 10])
    cache = cache.with_lengths(keep)
    b = a.copy()
    for r in range(B):
        b[r, keep[r] :] = fresh[r, keep[r] :]
    chunk = np.stack([b[r, keep[r] : keep[r] + 5] for r in range(B)])
    pos_b = keep[:, None] + np.arange(5)[None, :]
    out, _ = _fwd(cfg, params, chunk, jnp.asarray(pos_b, jnp.int32), cache)
    ref_b, _, _ = _hf_run(model, b)
    full_b, _ = _fwd(cfg, params, b, positions_like(jnp.asarray(b)))
    want = np.stack([ref_b[r, keep[r] : keep[r] + 5] for r in range(B)])
    want_ours = np.stack([np.asarray(full_b.logits)[r, keep[r] : keep[r] + 5] for r in range(B)])
    assert _maxdiff(out.logits, want) <= TOL
    assert _maxdiff(out.logits, want_ours) <= TOL
    # The re-verified tokens really differ from the rolled-back ones (the test can fail).
    stale = np.stack([ref_a[r, keep[r] : keep[r] + 5] for r in range(B)])
    assert _maxdiff(want, stale) > 1e-2


def test_sharded_checkpoint_and_mesh_load(ckpts, tmp_path):
    model, path = ckpts["llama"]
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in os.listdir(sharded) and len(shards) > 2
    cfg, params = load_target(path, target_layer_ids=LAYER_IDS)
    cfg_s, params_s = load_target(sharded, target_layer_ids=LAYER_IDS)
    assert cfg_s == cfg
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), params, params_s)

    from dspark_jax.parallel import make_mesh

    mesh = make_mesh(MeshConfig(data=2, tensor=4))
    _, params_m = load_target(sharded, mesh=mesh, target_layer_ids=LAYER_IDS)
    q = params_m["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (64, 16)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), params, params_m)


def test_bf16_load(ckpts, seqs):
    model, path = ckpts["qwen3"]
    cfg, params = load_target(path, dtype="bfloat16", target_layer_ids=LAYER_IDS)
    assert cfg.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    tokens, _ = seqs
    ref = _hf_run(model, tokens)[0]
    out, _ = _fwd(cfg, params, tokens, positions_like(jnp.asarray(tokens)))
    d = _maxdiff(out.logits, ref)
    print(f"bf16 qwen3: max |dlogit| = {d:.3f} (scale {np.abs(ref).max():.2f})")
    assert d <= 0.1 * np.abs(ref).max()
    agree = np.mean(np.argmax(np.asarray(out.logits), -1) == np.argmax(ref, -1))
    assert agree >= 0.9


def test_bf16_checkpoint_loads_as_fp32(ckpts, tmp_path):
    """A bf16 checkpoint (the usual release dtype) loads exactly into fp32 params."""
    cfg, params = load_target(ckpts["llama"][1], target_layer_ids=LAYER_IDS)
    out = save_target_hf(cfg, params, tmp_path / "bf16", dtype="bfloat16")
    assert load_file(os.path.join(out, "model.safetensors"))["lm_head.weight"].dtype == "bfloat16"
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["dtype"] == "bfloat16"
    cfg32, params32 = load_target(out)
    assert cfg32.dtype == "float32"
    bf16_rounded = lambda x: np.asarray(x.astype(jnp.bfloat16), np.float32)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(y, bf16_rounded(x)), params, params32)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_target_hf_round_trip(arch, ckpts, tmp_path, seqs):
    """Our params -> HF checkpoint -> transformers loads it -> same logits; and back again.

    The config is the loaded checkpoint's (so the compiled forward is reused); the params are
    fresh random ones, norms and biases included, so a dropped or misnamed tensor shows.
    """
    cfg = check_checkpoint(ckpts[arch][1], target_layer_ids=LAYER_IDS)
    params = random_params(cfg, 5)
    out_dir = save_target_hf(cfg, params, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, local_files_only=True, attn_implementation="eager"
    ).eval()
    assert type(hf).__name__ == _HF_CLASS[arch]
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    tokens, _ = seqs
    ref = _hf_run(hf, tokens)[0]
    out, _ = _fwd(cfg, params, tokens, positions_like(jnp.asarray(tokens)))
    d = _maxdiff(out.logits, ref)
    print(f"save_target_hf {arch}: max |dlogit| = {d:.2e}")
    assert d <= TOL
    cfg2, params2 = load_target(out_dir)
    assert cfg2 == cfg  # incl. target_layer_ids (not the default) and llama3 rope scaling
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), params, params2)


# -------------------------------------------------------------------------------------------------
# bad input


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **changes):
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(f, "w") as fh:
        json.dump(cfg, fh)


def _edit_tensors(path, drop=(), add=None):
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    for k in drop:
        del t[k]
    t.update(add or {})
    save_file(t, f, metadata={"format": "pt"})


def test_error_unknown_architecture(ckpts, tmp_path):
    p = _copy(ckpts["qwen3"][1], tmp_path / "c")
    _edit_config(p, architectures=["MistralForCausalLM"], model_type="mistral")
    with pytest.raises(CheckpointError, match="unsupported architecture.*Mistral"):
        load_target(p)


def test_error_unsupported_features(ckpts, tmp_path):
    p = _copy(ckpts["llama"][1], tmp_path / "c")
    _edit_config(p, attention_bias=True)
    with pytest.raises(CheckpointError, match="attention_bias"):
        load_target(p)
    _edit_config(p, attention_bias=False, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act 'gelu'"):
        load_target(p)


def test_error_missing_tensors(ckpts, tmp_path):
    p = _copy(ckpts["qwen3"][1], tmp_path / "c")
    _edit_tensors(p, drop=["model.layers.1.mlp.up_proj.weight", "model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.1\.mlp\.up_proj"):
        load_target(p)


def test_error_missing_untied_head(ckpts, tmp_path):
    p = _copy(ckpts["llama"][1], tmp_path / "c")
    _edit_tensors(p, drop=["lm_head.weight"])
    with pytest.raises(CheckpointError, match="missing tensors.*lm_head.*tie_word_embeddings"):
        load_target(p)


def test_error_unexpected_tensors(ckpts, tmp_path):
    p = _copy(ckpts["qwen3"][1], tmp_path / "c")
    _edit_tensors(p, add={"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*q_proj\.bias"):
        load_target(p)


def test_error_shape_mismatch(ckpts, tmp_path):
    p = _copy(ckpts["qwen2"][1], tmp_path / "c")
    _edit_config(p, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch for model\.layers\.0\.mlp\.\w+_proj.*\(.*96.*\).*128",
    ):
        check_checkpoint(p)


def test_error_missing_files(ckpts, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nowhere")
    p = _copy(ckpts["qwen3"][1], tmp_path / "noconfig")
    os.remove(os.path.join(p, "config.json"))
    with pytest.raises(CheckpointError, match="missing file: no config.json"):
        load_target(p)
    p = _copy(ckpts["qwen3"][1], tmp_path / "noweights")
    os.remove(os.path.join(p, "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing files: neither model.safetensors"):
        load_target(p)
    p = tmp_path / "sharded"
    ckpts["qwen3"][0].save_pretrained(p, max_shard_size="40KB")
    gone = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))[1]
    os.remove(p / gone)
    with pytest.raises(CheckpointError, match=f"missing files: shard.*{gone}"):
        load_target(p)
    with pytest.raises(CheckpointError, match="missing files: no tokenizer"):
        load_tokenizer(ckpts["qwen3"][1])


def _save_tokenizer(path, n_tokens):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, n_tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(path)


def test_tokenizer_loads_offline_and_must_fit(ckpts, tmp_path):
    cfg = check_checkpoint(ckpts["qwen3"][1])
    ok = _copy(ckpts["qwen3"][1], tmp_path / "ok")
    _save_tokenizer(ok, 200)
    tok = load_tokenizer(ok, cfg)
    assert tok("w5 w7")["input_ids"] == [5, 7]
    # save_target_hf carries the tokenizer along
    cfg, params = load_target(ok)
    out = save_target_hf(cfg, params, tmp_path / "with_tok", tokenizer=tok)
    assert load_tokenizer(out, cfg)("w9")["input_ids"] == [9]
    big = _copy(ckpts["qwen3"][1], tmp_path / "big")
    _save_tokenizer(big, 300)
    with pytest.raises(CheckpointError, match=r"tokenizer vocabulary \(300.*vocab_size=256"):
        load_tokenizer(big, cfg)


def test_request_validation():
    cfg = tiny_target_config()
    cache = jax.eval_shape(lambda: init_cache(cfg, 4, 64))  # shapes only, nothing allocated
    check_request_fits(cache, prompt_lens=[10, 20], max_new_tokens=30, lookahead=8)
    with pytest.raises(RequestError, match="prompt of request 1 is 80 tokens, longer than the KV"):
        check_request_fits(cache, prompt_lens=[10, 80])
    with pytest.raises(
        RequestError, match="batch of 5 requests is larger than the cache's 4 slots"
    ):
        check_request_fits(cache, prompt_lens=[3] * 5)
    with pytest.raises(RequestError, match="request 0 needs 70 cache positions.*<= 44"):
        check_request_fits(cache, prompt_lens=12, max_new_tokens=50, lookahead=8)
    with pytest.raises(RequestError, match="empty prompt"):
        check_request_fits(cache, prompt_lens=[0])
    with pytest.raises(RequestError, match="max_position_embeddings=512"):
        check_request_fits(max_len=1024, slots=1, prompt_lens=600, cfg=cfg)


def test_checks_run_before_reading_weights(ckpts, tmp_path, monkeypatch):
    """A bad checkpoint fails on headers alone: no tensor data is read."""
    import dspark_jax.models.hf as hf_mod

    p = _copy(ckpts["qwen3"][1], tmp_path / "c")
    _edit_tensors(p, drop=["model.norm.weight"])
    reads = []
    real_open = hf_mod.safe_open

    class SpySlice:
        def __init__(self, sl, name):
            self.sl, self.name = sl, name

        def get_shape(self):
            return self.sl.get_shape()

        def get_dtype(self):
            return self.sl.get_dtype()

        def __getitem__(self, index):
            reads.append(self.name)
            return self.sl[index]

    class SpyFile:
        def __init__(self, *args, **kwargs):
            self.cm = real_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return SpySlice(self.f.get_slice(name), name)

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(hf_mod, "safe_open", SpyFile)
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_target(p)
    assert reads == []
    _, params = load_target(ckpts["qwen3"][1])  # the spy does see reads of a good checkpoint
    assert len(reads) == len(jax.tree.leaves(params))
