"""The Hugging Face Trainer + DeepSpeed default a user would otherwise run: B2's reference.

    deepspeed --num_gpus 2 benchmarks/hf_trainer_loop.py --model DIR --data FILE.jsonl \\
        --config ds_config.json --max-seq-length 256 --times OUT.json --output DIR

Deliberately free of tuneq: the records are tokenized the way tuneq tokenizes text (EOS
appended, cut to ``--max-seq-length``, samples with fewer than two tokens dropped), then
handed to ``transformers.Trainer`` with the job's DeepSpeed config (``deepspeed=``) and the
collator users reach for, ``DataCollatorForLanguageModeling(tokenizer, mlm=False)``: every
micro-batch padded to its longest row, no packing. One epoch, micro-batch
``train_batch_size / ranks``, the config's learning rate, betas and eps (the Trainer checks
that its arguments agree with the config), seed 0.

One deliberate departure from the Trainer's defaults: ``lr_scheduler_type="constant"``. The
config has no scheduler, which in DeepSpeed (and so in tuneq) means a constant learning rate;
left alone, the Trainer would add its own linear decay and the two final losses would differ
for a reason that has nothing to do with packing.

Rank 0 writes to ``--times``: the wall-clock time at the end of every optimizer step (a
callback's ``on_step_end``, after the Trainer's DeepSpeed step), the logged loss per step,
the steps, the share of real (non-padding) tokens in rank 0's batches (a counting wrapper
around the collator, which it leaves unchanged), and the wall time of ``trainer.train()`` as
a whole (which includes building the DeepSpeed engine). The trained model is saved to
``--output`` after the timing, for the
held-out evaluation both sides go through.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def cpu_distributed_state() -> dict[str, Any]:
    """Start the ranks' process group for the Trainer on a host without GPUs.

    accelerate (1.16) knows no distributed backend for the device type "cpu" unless told
    ``use_cpu``, which turns DeepSpeed off; left alone it would give each rank a world of one
    (every rank training on all the data, the Trainer then rejecting train_batch_size). So
    the shared state is built first, for DeepSpeed, with the backend DeepSpeed's own
    ``init_distributed`` picks on this accelerator (what tuneq's ranks use), and the Trainer
    is told to use it. On a GPU host none of this runs: the Trainer starts as usual.
    """
    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend=get_accelerator().communication_backend_name())
    return {"use_configured_state": True}


def main() -> None:
    # DeepSpeed's launcher runs this file as a script: its own folder is on sys.path, the repository is not.
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from benchmarks.reference_cli import workload_parser

    parser = workload_parser()
    parser.add_argument("--output", required=True, type=Path, help="Trainer output_dir; the model is saved here")
    args = parser.parse_args()

    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    config: dict[str, Any] = json.loads(args.config.read_text())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator_config = cpu_distributed_state() if os.environ.get("DS_ACCELERATOR") == "cpu" else None
    micro_batch = config["train_batch_size"] // world_size // config.get("gradient_accumulation_steps", 1)
    adam = config["optimizer"]["params"]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:  # the usual recipe for a causal LM without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    eos = tokenizer.eos_token_id
    texts = [json.loads(line)["text"] for line in args.data.read_text().splitlines() if line.strip()]
    rows: list[dict[str, list[int]]] = []
    for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        ids = ids[: args.max_seq_length]
        if len(ids) >= 2:
            rows.append({"input_ids": ids})

    model = AutoModelForCausalLM.from_pretrained(args.model, use_safetensors=True)
    model.config.use_cache = False

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.times.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs") or {}
            if "loss" in logs:
                self.losses.append(float(logs["loss"]))

    class CountingCollator:
        """The default collator, counting real tokens and token slots (for the padding share)."""

        def __init__(self) -> None:
            self.inner = DataCollatorForLanguageModeling(tokenizer, mlm=False)
            self.real_tokens = 0
            self.slots = 0

        def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
            batch = self.inner(features)
            self.real_tokens += int(batch["attention_mask"].sum())
            self.slots += int(batch["attention_mask"].numel())
            return batch

    collator = CountingCollator()
    steps = StepTimes()
    training_args = TrainingArguments(
        output_dir=str(args.output),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=config.get("gradient_accumulation_steps", 1),
        num_train_epochs=1,
        learning_rate=adam["lr"],
        adam_beta1=adam["betas"][0],
        adam_beta2=adam["betas"][1],
        adam_epsilon=adam["eps"],
        lr_scheduler_type="constant",  # see the module docstring
        deepspeed=config,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        accelerator_config=accelerator_config,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        data_collator=collator,
        callbacks=[steps],
    )
    started = time.time()
    trainer.train()
    train_seconds = time.time() - started
    if trainer.is_world_process_zero():
        args.times.write_text(
            json.dumps(
                {
                    "step_times": steps.times,
                    "losses": steps.losses,
                    "steps": trainer.state.global_step,
                    "samples": len(rows),
                    "train_seconds": train_seconds,
                    # rank 0's batches (and any the loader prefetched): real tokens / slots
                    "real_token_share": collator.real_tokens / collator.slots if collator.slots else None,
                }
            )
        )
    trainer.save_model(str(args.output / "model"))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output / "model")


if __name__ == "__main__":
    main()
