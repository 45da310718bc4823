"""A real target: point the same pipeline at a local Qwen3 checkpoint and your own prompts.

    python train.py --config configs/qwen3_4b_dspark.py \
        --set target.path=/models/Qwen3-4B \
        --set data.conversation_files=/data/train.jsonl \
        --set data.eval_prompt_files=/data/gsm8k.jsonl,/data/humaneval.jsonl,/data/mt-bench.jsonl

Reference defaults (REFERENCE §8): γ = 7, 5 drafter layers, target layers [1, 9, 17, 25, 33],
vanilla Markov head r = 256, 512 anchors per sequence, sequences up to 4096 tokens, lr 6e-4.
The tokenizer and chat template come from the checkpoint directory; the drafter's mask token is
the first embedding row past the tokenizer vocabulary (151669 for Qwen3). Training at this size
wants accelerators: see README "Scale out".
"""

from dspark_jax.pipeline_config import (
    CalibrateStage,
    DrafterStage,
    EvalStage,
    PipelineConfig,
    RegenerateStage,
    TargetStage,
)


def config() -> PipelineConfig:
    return PipelineConfig(
        name="qwen3_4b_dspark",
        run_dir="runs/qwen3_4b_dspark",
        target=TargetStage(path="", target_layer_ids=(1, 9, 17, 25, 33)),
        regenerate=RegenerateStage(
            temperature=0.7,
            top_p=0.8,
            top_k=20,
            max_new_tokens=4096,
            max_prompts=1_300_000,
            batch_size=64,
        ),  # fmt: skip
        drafters=DrafterStage(
            kinds=("dspark", "dflash", "eagle3"),
            block_size=7,
            num_layers=5,
            markov_rank=256,
            num_anchors=512,
            steps=25_000,
            batch_size=512,
            seq_len=4096,
            lr=6e-4,
            eval_every=3000,
        ),  # fmt: skip
        calibrate=CalibrateStage(max_prompts=500, max_new_tokens=2048),
        evaluate=EvalStage(
            max_prompts_per_dataset=500,
            max_new_tokens=2048,
            batch_size=1,
            max_len=8192,
        ),  # fmt: skip
    )
