"""The weights a job starts from when its model names another job's LoRA adapter or DeepSpeed
checkpoint (worker.rank.base_weights), from checkpoints real DeepSpeed engines saved: a
checkpoint's weights are exactly the ones the job exported at that step, under ZeRO 2 (its fp32
master copies) and ZeRO 0 (the module's own); a LoRA checkpoint merged is the exported adapter
merged; a checkpoint that does not fit the model it names is refused, naming what is wrong.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import LoraOptions, TrainingOptions, TrainingSpec
from tests.worker.rank.test_recipe import DEEPSPEED_CONFIG, train
from worker.rank.base_weights import checkpoint_weights, merge_adapter

pytestmark = pytest.mark.slow

LORA = LoraOptions(r=4, alpha=8, dropout=0.0)
# In rows of 4 x 2: 6 optimizer steps, a checkpoint at 3 and at 6, the export at 6.
TRAINING = TrainingOptions(
    max_steps=6, packing=False, micro_batch_size=4, gradient_accumulation_steps=2, checkpoint_every_steps=3,
    learning_rate=1e-2, seed=3,
)  # fmt: skip


def weights(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of the model a directory holds, as from_pretrained loads it (a tied head
    whether or not the directory saved it twice)."""
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(directory, use_safetensors=True).state_dict())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=0, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_template: Path) -> dict[str, RunLayout]:
    """Three real runs of the tiny model, on one CPU rank: a full fine-tune under ZeRO 2 and
    under ZeRO 0, and LoRA adapters under ZeRO 2."""
    home = tmp_path_factory.mktemp("base-weights")
    from cli.samples import write_text_dataset

    dataset = write_text_dataset(home / "train.jsonl", records=64)

    def spec(name: str, deepspeed_config: dict[str, Any], **training: Any) -> TrainingSpec:
        run_dir = home / "runs" / name
        run_dir.mkdir(parents=True)
        return TrainingSpec(
            job_id=uuid.uuid4(),
            model=str(tiny_model_template),
            dataset=str(dataset),
            deepspeed_config=deepspeed_config,
            num_gpus=1,
            training=TRAINING.model_copy(update=training),
            run_dir=str(run_dir),
            cache_dir=str(home / "cache"),
        )

    zero_0 = {k: v for k, v in DEEPSPEED_CONFIG.items() if k != "zero_optimization"} | {
        "zero_optimization": {"stage": 0}
    }
    specs = [spec("zero-2", DEEPSPEED_CONFIG), spec("zero-0", zero_0), spec("lora", DEEPSPEED_CONFIG, lora=LORA)]
    train(specs)
    return {s.run_dir.rsplit("/", 1)[-1]: RunLayout(Path(s.run_dir)) for s in specs}


@pytest.mark.parametrize("run", ["zero-2", "zero-0"])
def test_a_checkpoints_weights_are_the_ones_its_job_exported_at_that_step(
    runs: dict[str, RunLayout], run: str, tiny_model_template: Path, tmp_path: Path
) -> None:
    layout = runs[run]
    base = str(tiny_model_template)
    for step in (3, 6):
        checkpoint_weights(
            base=base,
            revision=None,
            checkpoint=layout.checkpoints_dir / layout.checkpoint_tag(step),
            lora=None,
            out=tmp_path / f"step-{step}",
        )
    assert_same(weights(tmp_path / "step-6"), weights(layout.model_dir))
    # The step's own weights: the earlier checkpoint is neither the export nor the base.
    earlier, untrained = weights(tmp_path / "step-3"), weights(tiny_model_template)
    assert any(not torch.equal(earlier[k], v) for k, v in weights(layout.model_dir).items())
    assert any(not torch.equal(earlier[k], v) for k, v in untrained.items())
    # A directory from_pretrained loads, with the base's tokenizer (and chat template).
    assert (tmp_path / "step-6" / "config.json").is_file() and (tmp_path / "step-6" / "tokenizer.json").is_file()


def test_a_lora_checkpoint_merged_is_its_exported_adapter_merged(
    runs: dict[str, RunLayout], tiny_model_template: Path, tmp_path: Path
) -> None:
    layout, base = runs["lora"], str(tiny_model_template)
    merge_adapter(base=base, revision=None, adapter=layout.adapter_dir, out=tmp_path / "adapter")
    checkpoint = layout.checkpoints_dir / layout.checkpoint_tag(6)
    checkpoint_weights(base=base, revision=None, checkpoint=checkpoint, lora=LORA, out=tmp_path / "checkpoint")
    merged = weights(tmp_path / "adapter")
    assert_same(weights(tmp_path / "checkpoint"), merged)
    untrained = weights(tiny_model_template)
    assert merged.keys() == untrained.keys()  # a plain model again: no adapter left in it
    assert any(not torch.equal(merged[k], v) for k, v in untrained.items())

    # The adapters alone are no full model's weights.
    with pytest.raises(ValueError, match="the checkpoint does not fit the model it names: weights it lacks: "):
        checkpoint_weights(base=base, revision=None, checkpoint=checkpoint, lora=None, out=tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
