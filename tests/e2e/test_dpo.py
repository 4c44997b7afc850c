"""Preference tuning (DPO) end to end on real ``tuneq`` processes (issue 42): it learns the
preference on two ranks under ZeRO-3, it continues an SFT job's output with LoRA, and a worker
SIGKILLed mid-run is replaced without the reference being scored again.

The loss itself against TRL's is tests/worker/rank/test_preference_loss.py's; the recipe's
reference, resume and cache on one rank are tests/worker/rank/test_dpo_recipe.py's; what submit
refuses is tests/api's; the ``/v1`` door with the ``openai`` SDK is tests/e2e/test_openai_sdk.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config, write_preference_dataset, write_text_dataset
from shared.data.preference import read_preference_records
from shared.data.prepared import held_out_split

from .harness import Tuneq, all_events, job_body, succeeded_with_losses, wait_gone, wait_until

pytestmark = pytest.mark.slow

PAIRS = 96
VALIDATION_SPLIT = 0.25
SEED = 3


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    write_preference_dataset(home / "data" / "pairs.jsonl", records=PAIRS)
    write_text_dataset(home / "data" / "repeated.jsonl", records=96, vary=False)
    return home


def dpo_body(home: Path, *, zero_stage: int = 2, **training: Any) -> dict[str, Any]:
    config = seed_config(fp16=False, train_batch_size=8, zero_stage=zero_stage, lr=2e-4)
    options = {"method": "dpo", "dpo": {"beta": 0.5}, "max_seq_length": 64, "seed": SEED, **training}
    return job_body(home, "pairs.jsonl", deepspeed_config=config, training=options)


def preferred_share(model_dir: Path, pairs_file: Path, indices: Any) -> float:
    """How often the model gives the chosen answer a higher log-probability than the rejected one,
    over the given pairs of the file, tokenized as the ranks tokenize them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.data.tokenized import pair_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = read_preference_records(pairs_file, max_line_bytes=1 << 20)

    def answer_logp(prompt: list[int], answer: list[int]) -> float:
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        return float(logps[torch.arange(len(targets)), targets][len(prompt) - 1 :].sum())

    preferred = 0
    for i in indices:
        prompt, chosen, rejected = pair_ids(tokenizer, records.pairs[int(i)], where=f"line {i + 1}")
        preferred += answer_logp(prompt, chosen) > answer_logp(prompt, rejected)
    return preferred / len(indices)


def test_dpo_on_two_ranks_under_zero3_learns_the_preference(service: Tuneq, home: Path) -> None:
    body = dpo_body(home, zero_stage=3, max_steps=24, validation_split=VALIDATION_SPLIT, eval_every_steps=8)
    body["num_gpus"] = 2
    plan = service.client.post("/jobs/plan", json=body)
    assert plan.status_code == 200, plan.text
    assert plan.json()["reference_pass"]["pairs"] == PAIRS  # the whole file is scored once

    job, losses = succeeded_with_losses(service, body)
    assert job["training"]["method"] == "dpo" and job["training"]["dpo"]["beta"] == 0.5
    metrics = service.get(f"/jobs/{job['id']}/metrics")["data"]
    assert metrics[0]["rewards/accuracies"] == 0.0  # the policy starts as the reference: all ties
    evaluated = [m for m in metrics if m.get("eval_loss") is not None]
    assert [m["step"] for m in evaluated] == [8, 16, 24]
    assert evaluated[-1]["eval_rewards/accuracies"] > 0.9, evaluated
    assert losses[-1] < 0.5 * losses[0], losses
    events = all_events(service, job["id"])
    scored = [e["data"] for e in events if e["type"] == "phase"]
    assert scored[-1] == {"name": "reference_logps", "done": PAIRS, "total": PAIRS, "cached": False} | {
        "time": scored[-1]["time"]
    }

    # The exported model prefers the chosen answers of held-out pairs more often than the base did.
    _, held_out = held_out_split(PAIRS, VALIDATION_SPLIT, seed=SEED, unit="pairs")
    pairs_file = home / "data" / "pairs.jsonl"
    exported = Path(service.home) / "runs" / job["id"] / "model"
    before = preferred_share(home / "data" / "tiny-gpt-neo", pairs_file, held_out)
    after = preferred_share(exported, pairs_file, held_out)
    assert after > 0.9 and after > before, (before, after)


def test_sft_then_dpo_with_lora_on_its_output(service: Tuneq, home: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=2, lr=1e-2)
    sft, _ = succeeded_with_losses(
        service, job_body(home, "repeated.jsonl", deepspeed_config=config, training={"max_steps": 4})
    )
    body = dpo_body(home, max_steps=12, lora={"r": 8, "alpha": 32, "dropout": 0.0}, learning_rate=5e-3)
    body["model"] = f"job:{sft['id']}"
    body["deepspeed_config"]["optimizer"]["params"]["lr"] = 5e-3
    dpo, losses = succeeded_with_losses(service, body)
    assert dpo["model_source"]["job_id"] == sft["id"]
    assert losses[-1] < losses[0], losses
    metrics = service.get(f"/jobs/{dpo['id']}/metrics")["data"]
    assert metrics[-1]["rewards/margins"] > 0


def test_a_worker_killed_mid_dpo_is_replaced_and_the_reference_is_not_scored_again(
    tmp_path: Path, home: Path, redis_url: str
) -> None:
    env = {"TUNEQ_BROKER_URL": redis_url, "TUNEQ_LEASE_TTL_SECONDS": "6", "TUNEQ_RECONCILE_SECONDS": "1"}
    tuneq = Tuneq(home=tmp_path / "home", env={"TUNEQ_ALLOWED_ROOTS": str(home / "data"), **env}, split=True).start()
    try:
        steps = 120
        job = tuneq.submit(dpo_body(home, max_steps=steps, checkpoint_every_steps=5))
        wait_until(
            lambda: [c for c in tuneq.get(f"/jobs/{job['id']}/checkpoints")["data"] if c["kind"] == "deepspeed"],
            timeout=180,
            what="no checkpoint",
            tuneq=tuneq,
        )
        ranks = tuneq.ranks_of(job["id"])
        tuneq.kill(tuneq.processes[1])  # the worker and its pool, SIGKILL
        assert tuneq.job(job["id"])["step"] < steps, "the job finished before the worker was killed"
        assert wait_gone(ranks, timeout=30) == []
        # The host's cache of reference scores is gone too: only the checkpoint can hold them.
        shutil.rmtree(tuneq.home / "cache" / "reference")
        tuneq.start_worker()
        done = tuneq.wait(job["id"], timeout=400)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 2
        metrics = tuneq.get(f"/jobs/{job['id']}/metrics")["data"]
        assert [m["step"] for m in metrics] == list(range(1, steps + 1))  # no step repeated, none missing
        events = all_events(tuneq, job["id"])
        scored = [e["data"] for e in events if e["type"] == "phase" and e["data"]["done"] == e["data"]["total"]]
        assert [s["cached"] for s in scored] == [False, True], scored  # scored once, then read from the checkpoint
    finally:
        tuneq.stop()
