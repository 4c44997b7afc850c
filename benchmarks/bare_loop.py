"""The bare DeepSpeed loop a user would otherwise run by hand: B1's and B6's reference.

    deepspeed --num_gpus 2 benchmarks/bare_loop.py --model DIR --data FILE.jsonl \\
        --config ds_config.json --max-seq-length 256 --steps 20 --times OUT.json

Deliberately free of tuneq: the classic recipe (tokenizer and model from ``transformers``,
``deepspeed.initialize``, then ``engine(...)``, ``engine.backward(loss)``, ``engine.step()``,
a DeepSpeed checkpoint and a ``save_pretrained`` at the end). The batches are the ones tuneq
builds for the same job without packing: EOS appended, cut to ``--max-seq-length``, the
``DistributedSampler`` order of the same seed, each micro-batch padded to its longest row, so
both runs do identical work and only the service around the loop differs.

Rank 0 writes the wall-clock time after every optimizer step to ``--times``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

IGNORE_INDEX = -100


def main() -> None:
    # DeepSpeed's launcher runs this file as a script: its own folder is on sys.path, the repository is not.
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from benchmarks.reference_cli import workload_parser

    parser = workload_parser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--output", type=Path, default=None, help="checkpoint and model directory")
    args = parser.parse_args()

    import deepspeed
    import torch
    from deepspeed import comm as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    deepspeed.init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    set_seed(args.seed)
    config: dict[str, Any] = json.loads(args.config.read_text())

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines() if line.strip()]
    rows = [[*ids, tokenizer.eos_token_id][: args.max_seq_length] for ids in tokenizer(texts)["input_ids"]]

    def collate(batch: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, ids in enumerate(batch):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            attention_mask[r, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    micro_batch = config["train_batch_size"] // world_size // config.get("gradient_accumulation_steps", 1)
    sampler: DistributedSampler[Any] = DistributedSampler(
        rows,  # type: ignore[arg-type]
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
    )
    loader: DataLoader[Any] = DataLoader(
        rows,  # type: ignore[arg-type]
        batch_size=micro_batch,
        sampler=sampler,
        collate_fn=collate,
        drop_last=True,
    )

    model = AutoModelForCausalLM.from_pretrained(args.model, use_safetensors=True)
    model.config.use_cache = False  # no KV cache in training
    engine, _, _, _ = deepspeed.initialize(model=model, config_params=config, model_parameters=model.parameters())

    times: list[float] = []
    losses: list[float] = []
    engine.train()
    epoch = 0
    while engine.global_steps < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
            if engine.global_steps > len(times):  # an optimizer step, not an accumulation
                # The mean loss over the ranks, as a user's loop would print it (and as tuneq
                # reports it, so the two runs can be compared step by step).
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world_size)
                times.append(time.time())
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    if rank == 0:
        args.times.write_text(json.dumps({"step_times": times, "losses": losses}))
    if args.output is not None:
        engine.save_checkpoint(str(args.output / "checkpoints"))
        if rank == 0:
            engine.module.save_pretrained(args.output / "model", safe_serialization=True)
    dist.barrier()


if __name__ == "__main__":
    main()
