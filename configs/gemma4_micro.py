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

import dataclasses

from configs.micro import config as micro_config
from dspark_jax.config.pipeline import TargetStage


def config():
    """micro.py's drafter, calibration and evaluation sizes on a checkpoint's target (given with
    `--set target.path=...`), with Gemma's sampling and shorter runs."""
    base = micro_config()
    d, e = base.drafters, base.evaluate
    return dataclasses.replace(
        base,
        name="gemma4_micro",
        run_dir="runs/gemma4_micro",
        target=TargetStage(path=""),
        regenerate=dataclasses.replace(
            base.regenerate,
            temperature=1.0,
            top_p=0.95,
            top_k=64,
            max_new_tokens=24,
            max_prompts=32,
        ),  # fmt: skip
        drafters=dataclasses.replace(
            d,
            train=d.train.replace(total_steps=4, eval_interval=2, checkpoint_interval=2),
        ),
        calibrate=dataclasses.replace(base.calibrate, max_prompts=4, max_new_tokens=16),
        evaluate=dataclasses.replace(e, max_new_tokens=16, max_len=128),
    )
