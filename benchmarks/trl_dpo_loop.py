"""TRL's ``DPOTrainer`` under DeepSpeed, as a user would run it: B10's reference.

    deepspeed --num_gpus 2 benchmarks/trl_dpo_loop.py --model DIR --data PAIRS.jsonl \\
        --eval-data HELD_OUT.jsonl --config ds_config.json --max-seq-length 128 --steps 24 \\
        --beta 0.1 --times OUT.jsonl --output DIR [--precompute-ref-log-probs]

Deliberately free of tuneq: TRL's text preference records (``prompt``, ``chosen``,
``rejected``) handed to ``DPOTrainer`` with ``DPOConfig(deepspeed=<the job's config>)``, the
model given by its path so TRL loads it, and the reference as TRL makes it by default: a second
copy of the model, in a DeepSpeed inference engine (ZeRO stage 0 under ZeRO-1/2), run on every
step; or, with ``--precompute-ref-log-probs``, TRL's ``precompute_ref_log_probs=True``: no
second model, the reference scored once for the train and eval pairs while the trainer is built.

Where TRL's defaults differ from the job's, the job's are given, so both sides train alike:
no gradient checkpointing (DPOConfig turns it on), fp32 as the config says (DPOConfig turns
bf16 on), a constant learning rate (the config has no scheduler, which is constant for
DeepSpeed and tuneq; the Trainer would add linear decay), the config's learning rate, betas
and eps (the Trainer checks that they agree), micro-batch ``train_batch_size / ranks``.

Rank 0 writes JSON Lines to ``--times``: for every log the Trainer makes (every step, then the
evaluation at the end) ``{"step", "time", **logs}``, ``time`` being the wall-clock end of that
optimizer step (a callback's ``on_step_end``); then ``{"summary": {...}}``: how long building
the trainer (tokenizing; loading the reference, or precomputing its log-probabilities),
``train()`` and the final ``evaluate()`` took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _parse_args() -> argparse.Namespace:
    from benchmarks.reference_cli import workload_parser

    parser = workload_parser()
    parser.add_argument("--eval-data", required=True, type=Path, help="held-out pairs, evaluated at the end")
    parser.add_argument("--steps", required=True, type=int)
    parser.add_argument("--beta", required=True, type=float)
    parser.add_argument("--output", required=True, type=Path, help="the Trainer's output_dir")
    parser.add_argument("--precompute-ref-log-probs", action="store_true")
    return parser.parse_args()


def _dpo_config(args: argparse.Namespace, config: dict[str, Any]) -> Any:
    """TRL's arguments for the job: the config's batch, optimizer and precision, TRL's
    defaults that differ from the job's set to it (see the module docstring)."""
    from trl import DPOConfig

    from benchmarks.hf_trainer_loop import cpu_distributed_state

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = config.get("gradient_accumulation_steps", 1)
    micro_batch = config["train_batch_size"] // world_size // accumulation
    adam = config["optimizer"]["params"]
    return DPOConfig(
        output_dir=str(args.output),
        per_device_train_batch_size=micro_batch,
        per_device_eval_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        max_steps=args.steps,
        learning_rate=adam["lr"],
        adam_beta1=adam["betas"][0],
        adam_beta2=adam["betas"][1],
        adam_epsilon=adam["eps"],
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        beta=args.beta,
        max_length=args.max_seq_length,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        deepspeed=config,
        logging_steps=1,
        eval_strategy="no",  # one evaluation, after training, outside the timed steps
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        accelerator_config=cpu_distributed_state() if os.environ.get("DS_ACCELERATOR") == "cpu" else None,
    )


def _step_log(path: Path) -> Any:
    """A Trainer callback: each optimizer step's end time; each log, with it, a line of ``path`` (rank 0)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.step_ends: dict[int, float] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_ends[state.global_step] = time.time()

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                line = {"step": state.global_step, "time": self.step_ends.get(state.global_step), **kwargs["logs"]}
                with path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(line) + "\n")

    return StepLog()


def main() -> None:
    # DeepSpeed's launcher runs this file as a script: its own folder is on sys.path, the repository is not.
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    args = _parse_args()

    import torch.distributed as dist
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import DPOTrainer

    training_args = _dpo_config(args, json.loads(args.config.read_text()))  # starts the process group
    started = time.time()
    trainer = DPOTrainer(
        model=args.model,
        args=training_args,
        # From files, as users load them: in Datasets' cache, which the ranks share (TRL's precomputed
        # reference log-probabilities are written there by rank 0 and read by every rank).
        train_dataset=load_dataset("json", data_files=str(args.data), split="train"),
        eval_dataset=load_dataset("json", data_files=str(args.eval_data), split="train"),
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[_step_log(args.times)],
    )
    built = time.time()
    trainer.train()
    trained = time.time()
    trainer.evaluate()
    evaluated = time.time()
    if trainer.is_world_process_zero():
        summary = {
            "init_seconds": built - started,
            "train_seconds": trained - built,
            "evaluate_seconds": evaluated - trained,
            "reference_model": trainer.ref_model is not None,
            "attention": getattr(getattr(trainer.model, "config", None), "_attn_implementation", None),
            "steps": trainer.state.global_step,
        }
        with args.times.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"summary": summary}) + "\n")
    # Leave together and close the process group: a rank left to tear gloo down at interpreter
    # exit now and then aborts ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
