"""The drafter's configuration: `DrafterConfig` (DSpark, DFlash, Eagle3) for one target.
Re-exported by `dspark_jax.config`.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config.base import replace_checked
from dspark_jax.config.target import TargetConfig
from dspark_jax.errors import ConfigError

DRAFTER_KINDS = ("dspark", "dflash", "eagle3")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


# the baselines' heads and loss: no Markov head, no confidence head, CE only
_CE_ONLY = dict(markov_rank=0, confidence_head=False, confidence_with_markov=False, ce_alpha=1.0,
                l1_alpha=0.0, conf_alpha=0.0)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter for one target: DSpark, DFlash (modified, γ inputs -> γ predictions) or Eagle3.

    The drafter copies the target's per-layer shapes (hidden size, heads, head dim, FFN width,
    architecture, RoPE) from `target`, overriding the layer count; it reads the target features
    of `target.target_layer_ids` (m = len of those). Embedding and LM head are frozen copies of the
    target's (docs/METHOD.md §0, §2.1). A Gemma 4 target gives Gemma layers in its global geometry
    (`layer_config`, docs/METHOD.md §2.10), the scaled embedding and its soft-capped logits.
    Hashable: a static `jax.jit` argument.

    Fields (docs/METHOD.md §0, §2–5, §8):
      kind: "dspark" | "dflash" | "eagle3".
      num_layers: drafter decoder layers (5 for DSpark/DFlash; Eagle3 requires 1).
      block_size: γ, draft tokens per proposal (Eagle3: TTT horizon and proposal length).
      num_anchors: N_a anchor blocks per training sequence (DSpark/DFlash).
      mask_token_id: token id of the γ-1 mask slots; must be a row of the target embedding.
      markov_rank: r of the sequential head; 0 = no head (DFlash).
      markov_head_type: "vanilla" | "gated" | "rnn" (docs/METHOD.md §3.1–3.3).
      confidence_head: add the confidence head σ(w·[z; W1[x_prev]] + b) (docs/METHOD.md §3.5).
      confidence_with_markov: the confidence input includes the Markov embedding W1[x_prev].
      ce_alpha, l1_alpha, conf_alpha: loss weights α (docs/METHOD.md §4.2); l1 is full L1 (=2·TV).
      loss_decay_gamma: position weights exp(-k/g), k = 0..γ-1 (code default g = 4). None selects
        the paper's variant exp(-(k-1)/γ) (1-indexed), i.e. g = block_size.
      step_loss_decay: Eagle3 TTT step weight base (0.8^k).
      anchor_chunk: 0 = all N_a blocks at once; otherwise blocks are processed (and the loss
        reduced) in rematerialized chunks of this many anchors to bound activation memory.
        Must divide num_anchors.
      dtype: parameter / activation dtype ("float32" or "bfloat16"); losses are always fp32.
      seed: default RNG seed (42 for DSpark/DFlash, 0 for Eagle3 in the reference).
      context_window: 0 = the whole context; W > 0 = a DSpark/DFlash block anchored at position
        a sees only the context positions a - W .. a - 1 (the last W committed positions), an
        Eagle3 position t only the positions t - W + 1 .. t; in training and at serving time
        alike (`drafters.api.narrow_context_window` narrows it for serving, never widens it).
    """

    target: TargetConfig
    kind: str = "dspark"
    num_layers: int = 5
    block_size: int = 7
    num_anchors: int = 512
    mask_token_id: int = -1
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    conf_alpha: float = 1.0
    loss_decay_gamma: float | None = 4.0
    step_loss_decay: float = 0.8
    anchor_chunk: int = 0
    dtype: str = "float32"
    seed: int = 42
    context_window: int = 0

    def __post_init__(self):
        if not isinstance(self.target, TargetConfig):
            raise ConfigError("DrafterConfig.target must be the target's TargetConfig")
        if self.kind not in DRAFTER_KINDS:
            raise ConfigError(f"unknown drafter kind {self.kind!r}; supported: {DRAFTER_KINDS}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.num_layers < 1 or self.block_size < 1:
            raise ConfigError(
                f"num_layers={self.num_layers} and block_size={self.block_size} must be >= 1"
            )
        if not (isinstance(self.context_window, int) and self.context_window >= 0):
            raise ConfigError(
                f"context_window={self.context_window!r} must be an integer >= 0 (0 = the whole "
                "context)"
            )
        v = self.target.vocab_size
        if self.kind == "eagle3":
            if self.num_layers != 1:
                raise ConfigError(
                    f"Eagle3 has exactly one decoder layer (docs/METHOD.md §5.1); "
                    f"got num_layers={self.num_layers}"
                )
            if self.markov_rank or self.confidence_head:
                raise ConfigError(
                    "Eagle3 has no Markov or confidence head: set markov_rank=0, "
                    "confidence_head=False (or use DrafterConfig.eagle3(target))"
                )
        else:
            if not 0 <= self.mask_token_id < v:
                raise ConfigError(
                    f"mask_token_id={self.mask_token_id} is not a row of the target embedding "
                    f"(vocab_size={v}); pass the target's mask token (Qwen3: 151669)"
                )
            if self.num_anchors < 1:
                raise ConfigError(f"num_anchors={self.num_anchors} must be >= 1")
            if self.anchor_chunk < 0 or (
                self.anchor_chunk and self.num_anchors % self.anchor_chunk
            ):
                raise ConfigError(
                    f"anchor_chunk={self.anchor_chunk} must be 0 or divide "
                    f"num_anchors={self.num_anchors}"
                )
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank={self.markov_rank} must be >= 0 (0 = no head)")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"unknown markov_head_type {self.markov_head_type!r}; "
                f"supported: {MARKOV_HEAD_TYPES}"
            )
        if self.confidence_head and self.confidence_with_markov and not self.markov_rank:
            raise ConfigError(
                "confidence_with_markov=True needs a Markov head (markov_rank > 0); "
                "set confidence_with_markov=False or markov_rank > 0"
            )
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ConfigError(
                f"loss_decay_gamma={self.loss_decay_gamma} must be > 0 (None = paper variant)"
            )

    @property
    def decay_g(self) -> float:
        """The g of the position weights exp(-k/g) (paper variant: g = block_size)."""
        return float(self.block_size if self.loss_decay_gamma is None else self.loss_decay_gamma)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def feature_size(self) -> int:
        return self.target.feature_size

    @property
    def layer_config(self) -> TargetConfig:
        """The target config with the drafter's dtype: per-layer shapes of every draft layer.

        Gemma 4 target (docs/METHOD.md §0, §2.10): its text config with every layer full attention
        (the global layers' head size, K/V heads, K = V and RoPE), no KV-shared layers, no
        mixture of experts, no per-layer inputs, untied; at least as many layers as the drafter
        has (the target's feature layers stay valid)."""
        t = self.target.replace(dtype=self.dtype)
        if t.gemma is None:
            return t
        n = max(t.num_layers, self.num_layers)
        off = dict(num_kv_shared_layers=0, use_double_wide_mlp=False, num_experts=0)
        off.update(top_k_experts=0, moe_intermediate_size=0, hidden_size_per_layer_input=0)
        g = dataclasses.replace(
            t.gemma, layer_types=("full_attention",) * n, vocab_size_per_layer_input=0, **off
        )
        return t.replace(num_layers=n, tie_word_embeddings=False, gemma=g)

    @property
    def kv_geometry(self) -> tuple[int, int]:
        """(K/V heads, head size) of every draft layer (Gemma 4: the global layers')."""
        g = self.target.gemma
        if g is None:
            return self.target.num_kv_heads, self.target.head_dim
        return g.global_kv_heads, g.global_head_dim

    @property
    def logit_softcap(self) -> float | None:
        """The target's final-logit soft-cap c (Gemma 4; None: none): c·tanh(logits / c) on the
        draft logits and on the target logits the losses recompute (docs/METHOD.md §1.4, §2.10)."""
        g = self.target.gemma
        return None if g is None else g.final_logit_softcapping

    @property
    def embed_scale(self) -> float | None:
        """The factor of the scaled embedding (Gemma 4: sqrt(H); None: unscaled)."""
        return None if self.target.gemma is None else self.hidden_size**0.5

    def replace(self, **kw) -> DrafterConfig:
        return replace_checked(self, **kw)

    @classmethod
    def dspark(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """DSpark preset: 5 layers, γ=7, vanilla Markov r=256, confidence with Markov,
        α = (0.1, 0.9, 1.0), g = 4 (docs/METHOD.md §8)."""
        return cls(target=target, kind="dspark", **kw)

    @classmethod
    def dflash(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """Modified DFlash preset: same backbone, no heads, CE only."""
        return cls(target=target, kind="dflash", **{**_CE_ONLY, **kw})

    @classmethod
    def eagle3(cls, target: TargetConfig, **kw) -> DrafterConfig:
        """Eagle3 preset: 1 layer, TTT 7, step decay 0.8, soft-label CE, seed 0."""
        return cls(target=target, kind="eagle3", **{**_CE_ONLY, "num_layers": 1, "seed": 0, **kw})
