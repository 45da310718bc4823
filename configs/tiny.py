"""The embedded demo: a ~4M-parameter Qwen3 target trained here, three drafters, a τ table.

Proportions chosen by measurement (benchmarks/demo_proportions.py; docs/MEASUREMENTS.md, "Demo
proportions"):
a target deep relative to its drafters (16 layers x 160 rather than 6 x 256 at about the same
parameter count, 200 steps), target features from 5 layers spread over its depth (1, 4, 7, 10, 13;
Eagle3 reads the same ones), 2-layer DSpark / DFlash backbones with 128 anchor blocks per sequence
(about every anchor candidate of a 256-token window), regeneration at the evaluation temperature
(T = 1, no top-k / top-p), and one stated training budget for all three drafters: 300 optimizer
steps x 8 sequences x 256 tokens, accumulated over 2 micro-batches of 4.

`python train.py --config configs/tiny.py`
"""

from dspark_jax.config import TargetConfig, default_target_layer_ids
from dspark_jax.config.pipeline import (
    DRAFTER_TRAIN,
    TARGET_TRAIN,
    CalibrateStage,
    DrafterStage,
    EvalStage,
    PipelineConfig,
    RegenerateStage,
    TargetStage,
    TokenizerStage,
)

EVAL_TEMPERATURE = 1.0


def config() -> PipelineConfig:
    target = TargetConfig(
        architecture="qwen3",
        vocab_size=2048,  # replaced by the trained tokenizer's size (rounded up to 64)
        hidden_size=160,
        intermediate_size=320,
        num_layers=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=80,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        target_layer_ids=default_target_layer_ids(16),  # (1, 4, 7, 10, 13)
    )
    return PipelineConfig(
        name="tiny",
        run_dir="runs/tiny",
        tokenizer=TokenizerStage(vocab_size=2048),
        target=TargetStage(model=target, train=TARGET_TRAIN.replace(total_steps=200)),
        # the drafters learn the distribution they are evaluated on: T = 1, untruncated
        regenerate=RegenerateStage(
            max_prompts=1200,
            max_new_tokens=128,
            batch_size=32,  # 64 regenerated the same text in 233 s (192 s at 32, an earlier run)
            temperature=EVAL_TEMPERATURE,
            top_p=1.0,
            top_k=0,
        ),  # fmt: skip
        drafters=DrafterStage(
            kinds=("dspark", "dflash", "eagle3"),
            block_size=7,
            num_layers=2,  # DSpark / DFlash backbone depth (Eagle3 is always 1 layer)
            markov_rank=64,
            num_anchors=128,  # ~ every anchor candidate of a 256-token window
            train=DRAFTER_TRAIN.replace(
                total_steps=300,  # the same budget for the three drafters
                global_batch_size=8,
                micro_batch_size=4,  # gradients accumulated over 2 micro-batches
                eval_batch_size=4,
                seq_buckets=(256,),
                learning_rate=3e-3,
                eval_interval=100,
                checkpoint_interval=100,
                # the target's features computed once and shared by the three drafters (the
                # target's forward is most of an online step: 16 layers vs 1)
                feature_mode="offline",
            ),
        ),
        calibrate=CalibrateStage(max_prompts=48, max_new_tokens=96),
        evaluate=EvalStage(
            max_prompts_per_dataset=24,
            max_new_tokens=96,
            speed_prompts=4,
            temperature=EVAL_TEMPERATURE,
            temperatures=(0.0,),
            speed_reps=7,
        ),  # fmt: skip
    )
