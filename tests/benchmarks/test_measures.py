"""The benchmarks' own arithmetic: what the figures in BENCHMARKS.md are computed with."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.b1_training import WARMUP_STEPS, steps_per_second
from benchmarks.common import percentile
from benchmarks.results import Check, Stat
from benchmarks.workload import write_variable_length_dataset


def test_steps_per_second_leaves_out_the_warm_up() -> None:
    # Slow warm-up steps, then one step every 0.5 s.
    warm_up = [10.0 * i for i in range(WARMUP_STEPS)]
    times = warm_up + [warm_up[-1] + 0.5 * (i + 1) for i in range(8)]
    assert steps_per_second(times) == pytest.approx(2.0)


def test_steps_per_second_needs_timed_steps() -> None:
    with pytest.raises(ValueError, match="too few"):
        steps_per_second([1.0] * WARMUP_STEPS)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 1001)]
    assert percentile(values, 99) == 990.0
    assert percentile(values, 50) == 500.0
    assert percentile([3.0], 99) == 3.0


def test_a_missed_check_says_by_how_much() -> None:
    check = Check("ratio", Stat.of([0.4, 0.5, 0.45]), ">=", 0.6)
    assert not check.met
    assert check.missed_by == "0.15 (25.0 %)"
    assert Check("p99", Stat.of([10.0]), "<=", 20.0, unit=" ms").missed_by is None


def test_a_reported_figure_is_neither_met_nor_missed() -> None:
    from rich.console import Console

    from benchmarks.results import Result, print_table

    reported = Check.reported("publish ÷ write time", Stat.of([3.0, 2.0, 4.0]))
    assert reported.met is None and reported.missed_by is None
    assert reported.as_json()["met"] is None and reported.as_json()["target"] is None
    row = Result(id="B7", title="t", checks=[reported, Check("ratio", Stat.of([1.0]), ">=", 0.95)])
    assert row.as_json()["met"] is True  # a figure without a target does not fail its row
    missed = Result(id="B7", title="t", checks=[reported, Check("ratio", Stat.of([0.5]), ">=", 0.95)])
    assert missed.as_json()["met"] is False
    console = Console(record=True, width=200)
    print_table([row], console=console)
    assert "(reported)" in console.export_text()


def test_the_variable_length_dataset_has_a_long_tail(tmp_path: Path) -> None:
    path = write_variable_length_dataset(tmp_path / "data.jsonl", records=256)
    words = [len(json.loads(line)["text"].split()) for line in path.read_text().splitlines()]
    assert len(words) == 256
    assert max(words) > 10 * min(words)  # padding to the longest row of a batch wastes a lot
    assert sorted(words)[len(words) // 2] < max(words) / 4  # most records are short


def test_gpu_benchmark_refuses_too_few_steps_before_it_builds_or_runs_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import gpu

    monkeypatch.setenv("TUNEQ_BENCH_TMP", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        gpu.main(["--only", "neo-bf16", "--steps", str(gpu.WARMUP_STEPS), "--output", str(tmp_path / "out.json")])
    assert exited.value.code == 2
    assert f"use at least {gpu.WARMUP_STEPS + 1}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no model, no data, no result file


def test_gpu_rows_are_the_core_config_with_fp16_and_bf16_without_offload() -> None:
    from benchmarks.gpu import RUNS, Row, deepspeed_config, loss_differences

    assert {config for _, config in RUNS.values()} == {"fp16-offload", "bf16"}
    assert {model for model, _ in RUNS.values()} == {"gpt-neo", "llama"}
    offload = deepspeed_config("fp16-offload", cuda=True, train_batch_size=8)
    assert offload["fp16"] == {"enabled": True}
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    bf16 = deepspeed_config("bf16", cuda=True, train_batch_size=8)
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}
    assert "offload_optimizer" not in bf16["zero_optimization"]
    on_cpu = [deepspeed_config(name, cuda=False, train_batch_size=2) for name in ("fp16-offload", "bf16")]
    assert all(c["fp16"] == {"enabled": False} for c in on_cpu)  # no fp16 on CPU
    bare = Row("neo-bf16", "bare", 1.0, None, None, 0.0, losses=[2.0, 4.0, 0.0])
    tuneq = Row("neo-bf16", "tuneq", 1.0, None, None, 0.0, losses=[2.02, 3.96, 1.0])
    assert loss_differences(bare, tuneq) == pytest.approx([0.01, 0.01])  # a zero bare loss is skipped


def test_mfu_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import gpu

    # GPT-Neo 2.7B at 1024 tokens: 6 N dominates the attention term.
    per_token = gpu.flops_per_token(parameters=2_651_307_520, layers=32, hidden_size=2560, seq_length=1024)
    assert per_token == pytest.approx(6 * 2_651_307_520 + 12 * 32 * 2560 * 1024)
    assert gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("some accelerator") is None
    monkeypatch.setenv("TUNEQ_BENCH_PEAK_TFLOPS", "100")
    assert gpu.peak_flops("NVIDIA H200") == 100e12
    times = [0.0, 5.0, 6.0, 7.0, 8.0]  # warm-up steps, then one step a second
    assert gpu.tokens_per_second(times, 8192) == pytest.approx(8192.0)


def test_the_checkpoint_like_directory_is_distinct_random_files(tmp_path: Path) -> None:
    from benchmarks.b7_artifacts import write_checkpoint_like

    seconds = write_checkpoint_like(tmp_path / "ckpt", files=3, file_bytes=5000, chunk_bytes=2048)
    files = sorted((tmp_path / "ckpt").iterdir())
    assert [f.name for f in files] == ["part-00.pt", "part-01.pt", "part-02.pt"]
    assert all(f.stat().st_size == 5000 for f in files)
    assert len({f.read_bytes() for f in files}) == 3  # random bytes, not one file three times
    assert seconds > 0


def test_upload_waits_are_read_from_rank_0s_log_lines() -> None:
    from benchmarks.b7_artifacts import upload_waits

    lines = [
        "2026-12-06 05:58:01,234 rank0 INFO waited 2.5s for the upload of step-00000003",
        "2026-12-06 05:58:01,240 rank1 INFO waited 2.4s for the upload of step-00000003",  # the same wait
        "2026-12-06 05:58:09,001 rank0 INFO waited 0.0s for the upload of step-00000006",
        "2026-12-06 05:58:10,000 rank0 INFO saved checkpoint step-00000009",
    ]
    assert upload_waits(lines) == {3: 2.5, 6: 0.0}


def test_only_waits_before_the_timed_saves_count() -> None:
    from benchmarks.b7_artifacts import timed_wait_seconds

    # Saves at 3, 6, 9, 12 and the final one at 14; steps 4..14 are timed. The wait for step 3's
    # checkpoint is before the save of step 6 (timed); the wait for 12's is before the final save.
    waits = {3: 1.0, 6: 2.0, 9: 4.0, 12: 8.0}
    assert timed_wait_seconds(waits, every=3, warmup=4, steps=14) == 7.0
    assert timed_wait_seconds({}, every=3, warmup=4, steps=14) == 0.0


def test_checkpoint_bytes_is_the_newest_deepspeed_checkpoint() -> None:
    from benchmarks.b7_artifacts import checkpoint_bytes

    artifacts: list[dict[str, Any]] = [
        {"kind": "deepspeed", "step": 12, "size": 100},
        {"kind": "deepspeed", "step": 14, "size": 300},
        {"kind": "deepspeed", "step": 14, "size": 5},
        {"kind": "model", "step": 14, "size": 1000},
        {"kind": "log", "step": None, "size": 7},
    ]
    assert checkpoint_bytes(artifacts) == 305
    assert checkpoint_bytes([{"kind": "log", "step": None, "size": 7}]) == 0


def test_the_multi_node_job_is_b1s_world_spread_over_the_nodes(tmp_path: Path) -> None:
    from benchmarks import workload
    from benchmarks.b8_multi_node import job_body

    one = job_body(tmp_path, name="one", num_nodes=1)
    two = job_body(tmp_path, name="two", num_nodes=2)
    assert (one["num_nodes"], one["num_gpus"]) == (1, workload.RANKS)
    assert (two["num_nodes"], two["num_gpus"]) == (2, workload.RANKS // 2)
    # The same world size, so the same DeepSpeed config and batches: only the placement differs.
    assert {k: v for k, v in one.items() if k not in ("name", "num_gpus", "num_nodes")} == {
        k: v for k, v in two.items() if k not in ("name", "num_gpus", "num_nodes")
    }
    assert two["training"]["log_every_steps"] == 1
    with pytest.raises(ValueError, match="do not split"):
        job_body(tmp_path, name="three", num_nodes=3)


def test_omp_threads_are_the_launchers_share_of_a_workers_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.b8_multi_node import omp_threads
    from shared.jobs.hardware import Hardware

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two_cores = Hardware("cpu", 2)
    assert omp_threads(two_cores, ranks_per_node=2) == 1  # the 1-node job's ranks
    assert omp_threads(two_cores, ranks_per_node=1) == 2  # a 2-node job's lone rank per worker
    assert omp_threads(Hardware("cuda", 8), ranks_per_node=8) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the workers' environment wins, as in the launcher
    assert omp_threads(two_cores, ranks_per_node=1) == 3


def test_the_clusters_store_is_the_moto_bucket() -> None:
    from benchmarks.b7_artifacts import BUCKET
    from benchmarks.b8_multi_node import store_env

    env = store_env("http://127.0.0.1:5000")
    assert env["TUNEQ_S3_ENDPOINT_URL"] == "http://127.0.0.1:5000"
    assert env["TUNEQ_ARTIFACTS_URI"] == f"s3://{BUCKET}/b8"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]


def test_a_tuneq_dev_worker_is_told_from_the_api_by_whole_words() -> None:
    from benchmarks.training_runs import is_worker_command

    assert is_worker_command(["/venv/bin/python", "-P", "-m", "cli.main", "worker"])
    assert is_worker_command(["[celeryd:", "tuneq-1@vm:MainProcess]", "-active-", "(worker)"])
    assert is_worker_command(["[celeryd: tuneq-1@vm:MainProcess] -active- (worker)"])  # the title in one argument
    assert not is_worker_command(["/venv/bin/python", "-P", "-m", "cli.main", "serve", "--workers", "1"])


def test_dpo_steps_per_second_leaves_out_the_warm_up_and_the_evaluated_last_step() -> None:
    from benchmarks.b10_dpo import STEPS, WARMUP_STEPS, steady_steps_per_second

    warm_up = [10.0 * i for i in range(WARMUP_STEPS)]
    steady = [warm_up[-1] + 0.5 * (i + 1) for i in range(STEPS - WARMUP_STEPS - 1)]
    times = [*warm_up, *steady, steady[-1] + 30.0]  # the last step waits for the held-out evaluation
    assert steady_steps_per_second(times) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="too few"):
        steady_steps_per_second([1.0] * (WARMUP_STEPS + 1))


def test_dpo_sides_take_turns_reversed_every_other_repeat() -> None:
    from benchmarks.b10_dpo import in_turn

    order: list[tuple[str, int]] = []

    def side(name: str) -> Callable[[int], str]:
        def run(repeat: int) -> str:
            order.append((name, repeat))
            return f"{name}{repeat}"

        return run

    runs = in_turn(2, [side("a"), side("b"), side("c")])
    assert runs == [["a0", "a1"], ["b0", "b1"], ["c0", "c1"]]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)]


def test_dpo_measures_are_read_by_trls_name_or_the_columns() -> None:
    from benchmarks.b10_dpo import final_measure, loss_gap

    metrics: list[dict[str, Any]] = [
        {"step": 1, "loss": 0.69, "eval_rewards/accuracies": None},
        {"step": 2, "loss": 0.5, "eval_rewards/accuracies": 0.75, "eval_loss": 0.6},
        {"step": 3, "loss": 0.4, "eval_rewards_accuracies": 1.0, "eval_loss": 0.3},
    ]
    assert final_measure(metrics, "eval_rewards/accuracies") == 1.0
    assert final_measure(metrics, "eval_loss") == 0.3
    with pytest.raises(ValueError, match="eval_rewards/accuracies"):
        final_measure(metrics[:1], "eval_rewards/accuracies")
    assert loss_gap([0.5, 0.3], [0.5, 0.2]) == pytest.approx(0.5)


def test_the_reference_pass_is_timed_from_tuneqs_phase_events() -> None:
    from benchmarks.b10_dpo import reference_pass_seconds

    def phase(done: int, second: int, *, cached: bool = False) -> dict[str, Any]:
        data = {"name": "reference_logps", "done": done, "total": 320, "cached": cached}
        return {"type": "phase", "data": {**data, "time": f"2026-12-07T20:45:{second:02d}+00:00"}}

    plan = {"type": "plan", "data": {"total_steps": 24}}
    assert reference_pass_seconds([plan, phase(0, 41), phase(200, 43), phase(320, 45)]) == pytest.approx(4.0)
    assert reference_pass_seconds([phase(320, 41, cached=True)]) is None  # found, not computed
    assert reference_pass_seconds([plan]) is None


def test_trls_log_lines_give_steps_evaluation_and_summary() -> None:
    from benchmarks.b10_dpo import read_trl_log

    lines = [
        json.dumps({"step": 1, "time": 100.0, "loss": 0.69, "rewards/accuracies": 0.0}),
        json.dumps({"step": 2, "time": 101.5, "loss": 0.66, "rewards/accuracies": 1.0}),
        json.dumps({"step": 2, "time": 101.5, "train_runtime": 3.0, "train_loss": 0.67}),  # train()'s summary
        json.dumps({"step": 2, "time": 101.5, "eval_loss": 0.6, "eval_rewards/accuracies": 0.875}),
        json.dumps({"summary": {"init_seconds": 11.0}}),
        "",
    ]
    log = read_trl_log(lines)
    assert log.step_times == [100.0, 101.5] and log.losses == [0.69, 0.66]
    assert (log.held_out_accuracy, log.held_out_loss) == (0.875, 0.6)
    assert log.summary == {"init_seconds": 11.0}
    with pytest.raises(ValueError, match="did it finish"):
        read_trl_log(lines[:2])


def test_dpo_timed_step_durations_are_those_steps_per_second_averages() -> None:
    from benchmarks.b10_dpo import WARMUP_STEPS, steady_steps_per_second, timed_step_seconds

    times = [float(i) for i in range(WARMUP_STEPS)] + [WARMUP_STEPS - 1 + 0.5 * (i + 1) for i in range(5)] + [99.0]
    durations = timed_step_seconds(times)
    assert durations == pytest.approx([0.5] * 5)
    assert len(durations) / sum(durations) == pytest.approx(steady_steps_per_second(times))
