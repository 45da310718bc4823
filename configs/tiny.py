"""The embedded demo: a ~4M-parameter Qwen3 target trained here, three drafters, a τ table.

About 20 minutes on 2 CPU cores: `python train.py --config configs/tiny.py`.
"""

from dspark_jax.config import TargetConfig
from dspark_jax.pipeline_config import (
    CalibrateStage,
    DrafterStage,
    EvalStage,
    PipelineConfig,
    RegenerateStage,
    TargetStage,
    TokenizerStage,
)


def config() -> PipelineConfig:
    target = TargetConfig(
        architecture="qwen3",
        vocab_size=2048,  # replaced by the trained tokenizer's size (rounded up to 64)
        hidden_size=256,
        intermediate_size=512,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        target_layer_ids=(1, 2, 3),
    )
    return PipelineConfig(
        name="tiny",
        run_dir="runs/tiny",
        tokenizer=TokenizerStage(vocab_size=2048),
        target=TargetStage(model=target, steps=300, batch_size=16, seq_len=256, lr=3e-3),
        regenerate=RegenerateStage(max_prompts=1200, max_new_tokens=128, batch_size=32),
        drafters=DrafterStage(
            kinds=("dspark", "dflash", "eagle3"),
            block_size=7,
            num_layers=3,  # DSpark / DFlash backbone depth (Eagle3 is always 1 layer)
            markov_rank=64,
            num_anchors=64,
            steps=400,
            batch_size=8,
            seq_len=256,
            lr=3e-3,
            eval_every=100,
        ),
        calibrate=CalibrateStage(max_prompts=48, max_new_tokens=96),
        evaluate=EvalStage(max_prompts_per_dataset=24, max_new_tokens=96, speed_prompts=4),
    )
