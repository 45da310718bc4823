"""A seconds-scale Gemma 4 preset: the whole pipeline on the CPU with a small Gemma 4 checkpoint of
one's own (tests/test_pipeline.py runs it on a tiny random `Gemma4ForCausalLM`):

    python train.py --config configs/gemma4_micro.py \
        --set target.path=/models/tiny-gemma4 \
        --set data.conversation_files=/data/train.jsonl \
        --set data.eval_prompt_files=/data/eval.jsonl

The same code path as configs/dspark_gemma4_12b.py (the Gemma 4 rendering: `<|turn>model` turns,
the empty thought channel skipped by the loss, no default system prompt; `<turn|>` stops
generation; the mask token is the tokenizer's `<mask>` or `<|mask|>`), with micro.py's drafter
sizes, steps and counts; one device (the default mesh).
"""

from dspark_jax.pipeline_config import (
    DRAFTER_TRAIN,
    CalibrateStage,
    DrafterStage,
    EvalStage,
    PipelineConfig,
    RegenerateStage,
    TargetStage,
)


def config() -> PipelineConfig:
    return PipelineConfig(
        name="gemma4_micro",
        run_dir="runs/gemma4_micro",
        target=TargetStage(path=""),  # --set target.path=<checkpoint directory>
        regenerate=RegenerateStage(
            temperature=1.0,
            top_p=0.95,
            top_k=64,
            max_new_tokens=24,
            max_prompts=32,
            batch_size=16,
        ),  # fmt: skip
        drafters=DrafterStage(
            kinds=("dspark", "dflash", "eagle3"),
            block_size=4,
            num_layers=1,
            markov_rank=16,
            num_anchors=16,
            train=DRAFTER_TRAIN.replace(
                total_steps=4,
                global_batch_size=4,
                micro_batch_size=2,
                eval_batch_size=2,
                seq_buckets=(128,),
                eval_interval=2,
                checkpoint_interval=2,
                feature_mode="offline",  # the target's features computed once, shared
            ),
        ),  # fmt: skip
        calibrate=CalibrateStage(max_prompts=4, max_new_tokens=16),
        evaluate=EvalStage(
            max_prompts_per_dataset=3,
            max_new_tokens=16,
            batch_size=4,
            max_len=128,
            speed_prompts=1,
            speed_reps=2,
        ),  # fmt: skip
    )
