"""The reference's Gemma 4 target: Gemma4-12B-it (docs/METHOD.md §0, §2.10, §8), a local
checkpoint and your own prompts.

    python train.py --config configs/dspark_gemma4_12b.py \
        --set target.path=/models/gemma-4-12b-it \
        --set data.conversation_files=/data/train.jsonl \
        --set data.eval_prompt_files=/data/gsm8k.jsonl,/data/humaneval.jsonl,/data/mt-bench.jsonl

Reference settings: target layers [5, 17, 29, 41, 46], mask token 4 (the tokenizer's `<mask>`,
which the pipeline looks up), γ = 7, 5 drafter layers (Eagle3: 1), vanilla Markov head r = 256,
512 anchors per sequence, sequences up to 4096 tokens, lr 6e-4, 512 sequences per step. The
rendering follows the target (`Pipeline.render_config`): `<|turn>model` turns, every assistant
content prefixed with the empty thought channel `<|channel>thought\\n<channel|>` that the loss mask
skips, no default system prompt; `<turn|>` stops generation. The reference does not pin Gemma's
sampling for regeneration (docs/METHOD.md §1.2): temperature 1.0, top_p 0.95, top_k 64 here, what
Google's Gemma 3 model cards recommend — check them against the checkpoint's
generation_config.json (`--set regenerate.temperature=...`).

Slice: one host of 8 x H100 80 GB (`SLICE`), mesh fsdp=2 x tensor=4 (`mesh`), bf16 compute and
bf16 frozen target ("auto" on GPU), 64 anchors per rematerialized chunk; per optimizer step 512
sequences as 256 micro-steps of 2 (1 per fsdp shard). The trainer's memory plan per device for
google/gemma-4-12B-it's text config (48 layers, hidden 3840, a 262k vocabulary; the drafter
layers in its global geometry, 16 heads of 512; tests/test_memory.py prints it):

    dspark  params 4.07 GiB, optimizer 2.89 GiB, activations 1.29 GiB, logits 0.55 GiB = 8.8 GiB
    eagle3  params 3.51 GiB, optimizer 0.93 GiB, activations 6.04 GiB, logits 22.0 GiB = 32.5 GiB

of 72 GiB usable (90% of 80): Eagle3's γ TTT steps over the 262k vocabulary set the micro-batch
(2 per fsdp shard would plan about 61 GiB). The trainer refuses a plan that cannot fit and names
the field to change (`--set drafters.train.micro_batch_size=...` or `mesh.tensor=...`).

The released checkpoint is a `gemma4_unified` model in transformers' naming
(Gemma4UnifiedForConditionalGeneration, text config `gemma4_unified_text`): `load_target` reads
its text decoder (tests/test_gemma4.py checks the logits against transformers on tiny random
ones); configs/gemma4_micro.py runs this whole pipeline on a small `Gemma4ForCausalLM`.
"""

import dataclasses

from configs.qwen3_4b_dspark import config as qwen3_4b_config

SLICE = "8xH100-80GB"
TARGET_LAYER_IDS = (5, 17, 29, 41, 46)


def config():
    """The Qwen3-4B preset's settings (the reference's for every target) with Gemma's feature
    layers, its sampling and one sequence per fsdp shard."""
    base = qwen3_4b_config()
    d = base.drafters
    return dataclasses.replace(
        base,
        name="dspark_gemma4_12b",
        run_dir="runs/dspark_gemma4_12b",
        target=dataclasses.replace(base.target, target_layer_ids=TARGET_LAYER_IDS),
        regenerate=dataclasses.replace(base.regenerate, temperature=1.0, top_p=0.95, top_k=64),
        drafters=dataclasses.replace(
            d, train=d.train.replace(micro_batch_size=2, eval_batch_size=2)
        ),  # 256 micro-steps of gradient accumulation per step
    )
