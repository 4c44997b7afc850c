"""LoRA through peft, end to end: adapter-only checkpoints, the adapter export, the merged model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cli.samples import seed_config, write_text_dataset

from .harness import Tuneq, job_body

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    write_text_dataset(home / "data" / "train.jsonl", records=120)
    return home


def submit(service: Tuneq, home: Path, lora: dict[str, Any], **fields: Any) -> dict[str, Any]:
    config = seed_config(fp16=False, train_batch_size=2, lr=1e-2)
    training = {"max_steps": 4, "max_seq_length": 64, "checkpoint_every_steps": 2, "lora": lora}
    body = job_body(home, "train.jsonl", deepspeed_config=config, training=training) | fields
    return service.wait(service.submit(body)["id"], timeout=300)


def test_lora_checkpoints_hold_adapters_and_the_merge_matches(service: Tuneq, home: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "merge": True}
    job = submit(service, home, lora)
    assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
    checkpoints = service.get(f"/jobs/{job['id']}/checkpoints")["data"]
    by_kind = {(c["kind"], c["step"]): Path(c["uri"]) for c in checkpoints}
    assert {("deepspeed", 2), ("deepspeed", 4), ("adapter", 4), ("model", 4)} <= set(by_kind)

    # The DeepSpeed checkpoint holds what trained: the adapters, not the frozen base.
    [states] = by_kind[("deepspeed", 2)].glob("mp_rank_*_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert module and all("lora_" in name for name in module)

    base_dir = home / "data" / "tiny-gpt-neo"
    adapter_dir, merged_dir = by_kind[("adapter", 4)], by_kind[("model", 4)]
    assert (adapter_dir / "adapter_model.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()
    inputs = torch.tensor([[5, 17, 42, 9, 88, 3]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        base_logits = base(input_ids=inputs).logits
        adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
        adapted_logits = adapted(input_ids=inputs).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        merged_logits = merged(input_ids=inputs).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-4)  # the adapters trained
    torch.testing.assert_close(merged_logits, adapted_logits, atol=1e-4, rtol=1e-4)


def test_lora_under_zero3_on_two_ranks(service: Tuneq, home: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=2, zero_stage=3, lr=1e-2)
    job = submit(service, home, {"r": 2}, num_gpus=2, deepspeed_config=config)
    assert job["status"] == "succeeded", f"{job['error']}\n{service.log_tail()}"
    kinds = {c["kind"] for c in service.get(f"/jobs/{job['id']}/checkpoints")["data"]}
    assert kinds == {"deepspeed", "adapter"}  # no merged model unless asked


def test_unknown_target_modules_name_the_models_layers(service: Tuneq, home: Path) -> None:
    job = submit(service, home, {"target_modules": ["query_key_value"]})
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_input"
    message = job["error"]["message"]
    assert "training.lora.target_modules" in message and "q_proj" in message
