"""Multi-node jobs with real processes: one `tuneq serve`, and `tuneq worker`s with homes of
their own (as on separate hosts, sharing no disk) on Postgres, Redis and a loopback S3 store.
Every node advertises 127.0.0.1; the ranks of all nodes meet at node 0's rendezvous port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cli.samples import build_tiny_model, seed_config, write_preference_dataset, write_text_dataset
from tests.services import LoopbackS3, fresh_postgres_schema
from worker.warm_start import ZYGOTE_MODULE

from .conftest import s3_artifacts_env
from .harness import Tuneq, start_cluster, wait_gone, wait_until

pytestmark = pytest.mark.slow

STEPS = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("multi-node") / "data"
    build_tiny_model(data / "tiny-gpt-neo")
    write_text_dataset(data / "train.jsonl", records=64)
    write_preference_dataset(data / "pairs.jsonl", records=48)
    return data


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, data: Path, postgres_url: str, redis_url: str, loopback_s3: LoopbackS3
) -> Iterator[Tuneq]:
    """An API and three workers: two-node jobs, and two of them at once."""
    tuneq = start_cluster(
        tmp_path_factory.mktemp("cluster"),
        data,
        database=fresh_postgres_schema(postgres_url),
        broker=redis_url,
        store=s3_artifacts_env(loopback_s3, "multi-node"),
        hosts=3,
    )
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

    # Each node's worker records its own node finished, node 1's possibly just after the job ended.
    def finished() -> list[dict[str, Any]] | None:
        nodes: list[dict[str, Any]] = cluster.job(gang["id"])["nodes"]
        return nodes if {n["state"] for n in nodes} == {"finished"} else None

    nodes = wait_until(
        finished,
        timeout=30,
        what="the nodes never finished",
        tuneq=cluster,
    )
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

    # A worker keeps one warm start whatever it ran (its pool process's), not one per kind of
    # task: the two nodes' workers ran a node each, and one of the three the single-node job.
    for worker in cluster.processes[1:]:
        processes = psutil.Process(worker.pid).children(recursive=True)
        assert [ZYGOTE_MODULE in command_line(p) for p in processes].count(True) == 1


def test_a_dpo_gang_scores_the_reference_across_nodes_and_trains_as_one_node(cluster: Tuneq, data: Path) -> None:
    """Each node scores its ranks' share of the pairs, and every rank gets every score: the two
    nodes train as one node of two ranks does, step for step."""
    dpo = body(data, dataset=str(data / "pairs.jsonl"))
    dpo["training"] = {**dpo["training"], "method": "dpo", "dpo": {"beta": 0.5}}
    gang = cluster.wait(cluster.submit({**dpo, "num_gpus": 1, "num_nodes": 2})["id"], timeout=300)
    assert gang["status"] == "succeeded", (gang["error"], cluster.log_tail())
    single = cluster.wait(cluster.submit({**dpo, "num_gpus": 2})["id"], timeout=300)
    assert single["status"] == "succeeded", single["error"]
    assert losses(cluster, gang["id"]) == pytest.approx(losses(cluster, single["id"]), rel=1e-4)
    margins = [m["rewards/margins"] for m in cluster.get(f"/jobs/{gang['id']}/metrics?limit=1000")["data"]]
    assert margins[-1] > margins[0]


def command_line(process: psutil.Process) -> str:
    """Its command line; empty for one that has just exited."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_gang_larger_than_the_workers_is_refused_at_submit(cluster: Tuneq, data: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=4, zero_stage=2)
    answer = cluster.client.post("/jobs", json=body(data, num_gpus=1, num_nodes=4, deepspeed_config=config))
    assert answer.status_code == 422, answer.text
    (problem,) = answer.json()["detail"]
    assert problem["loc"] == ["body", "num_nodes"] and "3 live worker" in problem["msg"]


def test_two_gangs_on_three_workers_both_finish_one_after_the_other(cluster: Tuneq, data: Path) -> None:
    first = cluster.submit(body(data, num_gpus=1, num_nodes=2))
    second = cluster.submit(body(data, num_gpus=1, num_nodes=2))
    done = [cluster.wait(job["id"], timeout=400) for job in (first, second)]
    assert [d["status"] for d in done] == ["succeeded", "succeeded"], [d["error"] for d in done]
    # One after the other: three workers hold one gang of two at a time, so the second shares
    # a worker with the first (a worker runs one node at a time) and was placed once it was free.
    assert all(d["attempts"] == 1 for d in done)
    workers = [{n["worker_id"] for n in d["nodes"]} for d in done]
    assert workers[0] & workers[1] and done[1]["started_at"] > done[0]["started_at"]


def test_a_zero3_gang_exports_the_full_model(cluster: Tuneq, data: Path, tmp_path: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=2, zero_stage=3, lr=1e-3)
    done = cluster.wait(cluster.submit(body(data, num_gpus=1, num_nodes=2, deepspeed_config=config))["id"], timeout=300)
    assert done["status"] == "succeeded", done["error"]
    paths = {a["path"] for a in cluster.get(f"/jobs/{done['id']}/artifacts")["data"]}
    tag = f"checkpoints/step-{STEPS:08d}"
    # ZeRO-3: each rank's model and optimizer shards, from the node that ran it.
    for rank in (0, 1):
        assert f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" in paths
        assert f"{tag}/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in paths or any(
            p.startswith(f"{tag}/") and f"zero_pp_rank_{rank}_" in p and "optim" in p for p in paths
        )
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in sorted(p for p in paths if p.startswith("model/")):
        target = model_dir / path.removeprefix("model/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(cluster.client.get(f"/jobs/{done['id']}/artifacts/{path}").content)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(data / "tiny-gpt-neo")
    trained, original = model.state_dict(), base.state_dict()
    assert trained.keys() == original.keys()
    assert all(trained[k].shape == original[k].shape for k in trained)  # full tensors, not shards
    assert any(not trained[k].equal(original[k]) for k in trained)


def test_cancel_stops_both_nodes(cluster: Tuneq, data: Path) -> None:
    job = cluster.submit(
        body(data, num_gpus=1, num_nodes=2, training={"max_seq_length": 48, "max_steps": 100_000, "epochs": 1000})
    )
    deadline = time.monotonic() + 180
    while cluster.job(job["id"])["step"] < 3:
        assert time.monotonic() < deadline, cluster.log_tail()
        time.sleep(0.3)
    ranks = cluster.ranks_of(job["id"])
    assert len(ranks) == 2  # one per node
    assert cluster.client.post(f"/jobs/{job['id']}/cancel").status_code == 200
    done = cluster.wait(job["id"], timeout=60)
    assert done["status"] == "cancelled" and done["attempts"] == 1
    assert wait_gone(ranks, timeout=30) == []
    deadline = time.monotonic() + 30  # each node's worker finishes its node as its ranks go
    while [n["state"] for n in cluster.job(job["id"])["nodes"]] != ["finished", "finished"]:
        assert time.monotonic() < deadline, cluster.job(job["id"])["nodes"]
        time.sleep(0.5)


def test_a_gangs_checkpoint_starts_a_job_on_another_node_count(cluster: Tuneq, data: Path) -> None:
    """resume_from a 2-node job's checkpoint on one node and one rank: through DeepSpeed's
    universal checkpoint, from every node's shards in the store."""
    gang = cluster.wait(cluster.submit(body(data, num_gpus=1, num_nodes=2))["id"], timeout=300)
    assert gang["status"] == "succeeded", gang["error"]
    follow = cluster.submit(body(data, num_gpus=1, resume_from={"job_id": gang["id"]}))
    assert follow["resume_from"] == {"job_id": gang["id"], "step": STEPS}
    done = cluster.wait(follow["id"], timeout=300)
    assert done["status"] == "succeeded", (done["error"], cluster.log_tail())
    assert done["nodes"] == [] and done["step"] > 0
