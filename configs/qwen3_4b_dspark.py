"""A real target: point the same pipeline at a local Qwen3 checkpoint and your own prompts.

    python train.py --config configs/qwen3_4b_dspark.py \
        --set target.path=/models/Qwen3-4B \
        --set data.conversation_files=/data/train.jsonl \
        --set data.eval_prompt_files=/data/gsm8k.jsonl,/data/humaneval.jsonl,/data/mt-bench.jsonl

Reference defaults (docs/METHOD.md §8): γ = 7, 5 drafter layers, target layers [1, 9, 17, 25, 33],
vanilla Markov head r = 256, 512 anchors per sequence, sequences up to 4096 tokens, lr 6e-4.
The tokenizer and chat template come from the checkpoint directory; the drafter's mask token is
the first embedding row past the tokenizer vocabulary (151669 for Qwen3).

Slice: one host of 8 x H100 80 GB (`SLICE`), mesh fsdp=2 x tensor=4 (`mesh`). Per optimizer step
512 sequences of up to 4096 tokens as 128 micro-steps of 4 (2 per fsdp shard), bf16 compute and
bf16 frozen target ("auto" on GPU), 64 anchors per rematerialized chunk. The trainer's memory plan
per device (tests/test_memory.py prints it; XLA's own analysis is printed at start-up):

    dspark  params 1.49 GiB, optimizer 1.29 GiB, activations 3.80 GiB, logits 0.63 GiB = 7.2 GiB
    eagle3  params 1.23 GiB, optimizer 0.40 GiB, activations 18.6 GiB, logits 25.5 GiB = 45.8 GiB

of 72 GiB usable (90% of 80): Eagle3's γ TTT steps over full 4096-token sequences and the 152k
vocabulary set the micro-batch. On another slice change `mesh` and `drafters.train.micro_batch_size`
(`--set mesh.tensor=... drafters.train.micro_batch_size=...`); the trainer refuses a plan that cannot
fit and names the field to change. The same command runs on one process per host after
`jax.distributed.initialize()` (each process then reads only its own shard of the data).
"""

from dspark_jax.config import MeshConfig
from dspark_jax.config.pipeline import (
    DRAFTER_TRAIN,
    CalibrateStage,
    DrafterStage,
    EvalStage,
    PipelineConfig,
    RegenerateStage,
    TargetStage,
)

SLICE = "8xH100-80GB"


def config() -> PipelineConfig:
    return PipelineConfig(
        name="qwen3_4b_dspark",
        run_dir="runs/qwen3_4b_dspark",
        mesh=MeshConfig(data=1, fsdp=2, tensor=4),
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
            train=DRAFTER_TRAIN.replace(
                total_steps=25_000,
                global_batch_size=512,
                micro_batch_size=4,  # 128 micro-steps of gradient accumulation per step
                eval_batch_size=4,
                seq_buckets=(4096,),
                learning_rate=6e-4,
                eval_interval=3000,
                checkpoint_interval=3000,
                compute_dtype="auto",  # bf16 on GPU/TPU
                target_dtype="auto",
                anchor_chunk=64,
            ),
        ),  # fmt: skip
        calibrate=CalibrateStage(max_prompts=500, max_new_tokens=2048),
        evaluate=EvalStage(
            max_prompts_per_dataset=500,
            max_new_tokens=2048,
            batch_size=1,
            max_len=8192,
        ),  # fmt: skip
    )
