"""Multi-node jobs with real processes: one `tuneq serve`, and `tuneq worker`s with homes of
their own (as on separate hosts, sharing no disk) on Postgres, Redis and a loopback S3 store.
Every node advertises 127.0.0.1; the ranks of all nodes meet at node 0's rendezvous port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from cli.samples import build_tiny_model, seed_config, write_text_dataset
from tests.services import LoopbackS3, fresh_postgres_schema

from .conftest import s3_artifacts_env
from .harness import Tuneq

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("multi-node") / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=64)
    return data


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, data: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> Iterator[Tuneq]:
    """An API and two workers, each worker on a home of its own (another "host")."""
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    root = tmp_path_factory.mktemp("cluster")
    database = fresh_postgres_schema(postgres_url)
    env = {
        "TUNEQ_DATABASE_URL": database,
        "TUNEQ_BROKER_URL": redis_url,
        "TUNEQ_ALLOWED_ROOTS": str(data),
        "TUNEQ_RECONCILE_SECONDS": "1",
        "TUNEQ_WORKER_ADDRESS": "127.0.0.1",
        **s3_artifacts_env(loopback_s3, "multi-node"),
    }
    tuneq = Tuneq(home=root / "api", env=env, split=True)
    tuneq.start(workers=0, ready="/healthz")
    for host in ("host-a", "host-b"):
        tuneq.start_worker(TUNEQ_HOME=str(root / host))
    engine = create_engine(database)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                if conn.execute(text("SELECT count(*) FROM workers WHERE stopped_at IS NULL")).scalar() == 2:
                    break
            time.sleep(0.5)
        else:
            raise TimeoutError(f"the workers never registered\n{tuneq.log_tail()}")
    finally:
        engine.dispose()
    yield tuneq
    tuneq.stop()


def body(data: Path, **fields: Any) -> dict[str, Any]:
    return {
        "model": str(data / "tiny-gpt-neo"),
        "dataset": str(data / "train.jsonl"),
        "deepspeed_config": seed_config(fp16=False, train_batch_size=2, zero_stage=2, lr=1e-3),
        "training": {"max_seq_length": 48, "max_steps": STEPS, "checkpoint_every_steps": 6, "seed": 7},
        **fields,
    }


def losses(tuneq: Tuneq, job_id: str) -> list[float]:
    return [m["loss"] for m in tuneq.get(f"/jobs/{job_id}/metrics?limit=1000")["data"]]


def test_two_nodes_train_as_one_node_with_two_ranks(cluster: Tuneq, data: Path) -> None:
    gang = cluster.submit(body(data, num_gpus=1, num_nodes=2))
    assert gang["num_nodes"] == 2
    done = cluster.wait(gang["id"], timeout=300)
    assert done["status"] == "succeeded", (done["error"], cluster.log_tail())
    assert done["attempts"] == 1 and done["step"] == STEPS
    nodes = done["nodes"]
    assert [(n["node_rank"], n["ranks"], n["state"]) for n in nodes] == [
        (0, [0, 0], "finished"),
        (1, [1, 1], "finished"),
    ]
    assert len({n["worker_id"] for n in nodes}) == 2 and {n["address"] for n in nodes} == {"127.0.0.1"}

    # Same world size on one node (the two workers have two CPU "devices" each), same seed:
    # the same steps, to float precision.
    single = cluster.wait(cluster.submit(body(data, num_gpus=2))["id"], timeout=300)
    assert single["status"] == "succeeded", single["error"]
    assert single["nodes"] == []
    assert losses(cluster, gang["id"]) == pytest.approx(losses(cluster, single["id"]), rel=1e-4)

    # Each checkpoint is committed with both nodes' shares: the model states (node 0's copy)
    # and each rank's optimizer shard, uploaded by the node that ran it.
    checkpoints = [c for c in cluster.get(f"/jobs/{gang['id']}/checkpoints")["data"] if c["kind"] == "deepspeed"]
    assert sorted(c["step"] for c in checkpoints) == [6, 12]
    paths = {a["path"] for a in cluster.get(f"/jobs/{gang['id']}/artifacts")["data"] if a["step"] == STEPS}
    tag = f"checkpoints/step-{STEPS:08d}"
    assert {p.removeprefix(tag + "/") for p in paths if p.startswith(tag)} >= {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "tuneq-manifest.json",
    }
    assert any(p.startswith("model/") and p.endswith(".safetensors") for p in paths)
    # Node 1's log lines reached the job's log (its worker ingests them).
    lines = [
        e["data"]["line"] for e in cluster.get(f"/jobs/{gang['id']}/events?limit=1000")["data"] if e["type"] == "log"
    ]
    assert any("rank1" in line for line in lines), lines[-20:]


def test_a_gang_larger_than_the_workers_is_refused_at_submit(cluster: Tuneq, data: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=3, zero_stage=2)
    answer = cluster.client.post("/jobs", json=body(data, num_gpus=1, num_nodes=3, deepspeed_config=config))
    assert answer.status_code == 422, answer.text
    (problem,) = answer.json()["detail"]
    assert problem["loc"] == ["body", "num_nodes"] and "2 live worker" in problem["msg"]
