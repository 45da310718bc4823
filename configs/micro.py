"""A seconds-scale preset for the end-to-end CI test (same code path as configs/tiny.py)."""

import dataclasses

from configs.tiny import config as tiny_config
from dspark_jax.config.corpus import CorpusConfig
from dspark_jax.config.pipeline import (
    DRAFTER_TRAIN,
    TARGET_TRAIN,
    CalibrateStage,
    DataStage,
    DrafterStage,
    EvalStage,
    TargetStage,
    TokenizerStage,
)


def config():
    base = tiny_config()
    target = base.target.model.replace(
        hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2, num_kv_heads=1,
        head_dim=32, target_layer_ids=(0, 1, 2),
    )  # fmt: skip
    return dataclasses.replace(
        base,
        name="micro",
        run_dir="runs/micro",
        data=DataStage(
            corpus=CorpusConfig(n_math=200, n_heldout=8, max_code_files=20, max_prose_topics=12)
        ),
        tokenizer=TokenizerStage(vocab_size=512),
        target=TargetStage(
            model=target,
            train=TARGET_TRAIN.replace(
                total_steps=30, global_batch_size=8, micro_batch_size=8, seq_buckets=(128,)
            ),
        ),
        regenerate=dataclasses.replace(
            base.regenerate, max_prompts=48, max_new_tokens=32, batch_size=16
        ),
        drafters=DrafterStage(
            kinds=("dspark", "dflash", "eagle3"),
            block_size=4,
            num_layers=1,
            markov_rank=16,
            num_anchors=16,
            train=DRAFTER_TRAIN.replace(
                total_steps=6,
                global_batch_size=4,
                micro_batch_size=2,
                eval_batch_size=2,
                seq_buckets=(128,),
                eval_interval=3,
                checkpoint_interval=3,
                feature_mode="offline",  # the target's features computed once, shared
            ),
        ),  # fmt: skip
        calibrate=CalibrateStage(max_prompts=6, max_new_tokens=24),
        evaluate=EvalStage(
            max_prompts_per_dataset=3,
            max_new_tokens=24,
            batch_size=4,
            speed_prompts=1,
            speed_reps=2,
        ),  # fmt: skip
    )
