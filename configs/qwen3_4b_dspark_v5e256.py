"""The 4B preset on a Cloud TPU v5e-256 pod slice: 64 hosts x 4 chips, 16 GiB of HBM per chip.

Same models, data, schedule as `configs/qwen3_4b_dspark.py` (docs/METHOD.md §8); only the mesh and
the micro-batch change. One command per host, identical on every host (`--distributed`: JAX reads
the slice's topology and this host's index from the TPU metadata):

    gcloud compute tpus tpu-vm ssh my-v5e-256 --zone=us-west4-a --worker=all --command="\\
        cd dspark-jax && python train.py --config configs/qwen3_4b_dspark_v5e256.py --distributed \\
        --run-dir /mnt/shared/runs/qwen3_4b_v5e256 \\
        --set target.path=/mnt/shared/models/Qwen3-4B \\
        --set data.conversation_files=/mnt/shared/data/train.jsonl \\
        --set data.eval_prompt_files=/mnt/shared/data/gsm8k.jsonl,/mnt/shared/data/humaneval.jsonl"

The run directory, the checkpoint and the data must be on a filesystem every host mounts at the
same path (Filestore / NFS, or a bucket through gcsfuse).

Mesh data 4 x fsdp 8 x tensor 8 = 256 chips. Eagle3 sets it: its γ TTT steps over 4096-token
sequences and the 152k vocabulary need the logits split 8 ways to fit one sequence per fsdp
shard (at tensor 4 it plans 22.3 GiB per chip and the trainer refuses it). Per optimizer step 512
sequences as 16 micro-steps of 32 (one per data x fsdp shard), bf16. The trainer's plan per chip
(tests/test_memory.py computes it on 256 simulated devices):

    dspark  params 0.22 GiB, optimizer 0.28 GiB, activations 1.07 GiB, logits 0.16 GiB = 1.73 GiB
    dflash  params 0.18 GiB, optimizer 0.16 GiB, activations 1.07 GiB, logits 0.16 GiB = 1.57 GiB
    eagle3  params 0.16 GiB, optimizer 0.08 GiB, activations 5.03 GiB, logits 6.38 GiB = 11.64 GiB

of 14.4 GiB usable (90% of 16). The tensor axis (8) spans two hosts of 4 chips, over the slice's
ICI; with it spanning processes each host reads every row of the data and keeps its share.
"""

import dataclasses

from configs.qwen3_4b_dspark import config as gpu_config
from dspark_jax.config import MeshConfig

SLICE = "v5e-256"
DEVICE_MEMORY_GIB = 16


def config():
    base = gpu_config()
    train = base.drafters.train.replace(micro_batch_size=32)  # 16 micro-steps of 512
    return dataclasses.replace(
        base,
        name="qwen3_4b_dspark_v5e256",
        run_dir="runs/qwen3_4b_dspark_v5e256",
        mesh=MeshConfig(data=4, fsdp=8, tensor=8),
        drafters=dataclasses.replace(base.drafters, train=train),
    )
