"""What the API tests share: a valid job body over files under the allowed root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config


@pytest.fixture
def dataset(tuneq_home: Path) -> Path:
    path = tuneq_home / "data" / "train.jsonl"
    path.write_text('{"text": "hello world"}\n')
    return path


@pytest.fixture
def body(model_dir: Path, dataset: Path) -> dict[str, Any]:
    return {"model": str(model_dir), "dataset": str(dataset), "deepspeed_config": seed_config(fp16=False)}
