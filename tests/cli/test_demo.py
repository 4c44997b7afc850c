"""`tuneq demo`'s own lines (cli/demo.py); the whole demo runs in tests/e2e/test_demo.py."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

import pytest

from cli.demo import StepOrderedLines, due_checkpoints, try_model_command


def test_a_checkpoints_line_comes_after_its_step_though_its_event_comes_later() -> None:
    """The checkpoint of step 20 is recorded once its files are stored, here after step 35's
    metric: it used to be printed after "step 35/40"."""
    printed: list[str] = []
    lines = StepOrderedLines(due_checkpoints({"max_steps": 40, "checkpoint_every_steps": 20}), printed.append)
    lines.add(0, "plan: 40 steps on 1 rank(s)")
    for step in range(1, 36):
        lines.add(step, f"step {step}/40")
    assert printed[-1] == "step 20/40"  # the later steps wait for the checkpoint that is due
    lines.add(20, "checkpoint deepspeed at step 20", checkpoint=True)
    for step in range(36, 41):
        lines.add(step, f"step {step}/40")
    lines.add(40, "checkpoint deepspeed at step 40", checkpoint=True)
    lines.add(40, "checkpoint model at step 40", checkpoint=True)
    lines.flush()
    steps = [f"step {step}/40" for step in range(1, 41)]
    assert printed == [
        "plan: 40 steps on 1 rank(s)",
        *steps[:20],
        "checkpoint deepspeed at step 20",
        *steps[20:],
        "checkpoint deepspeed at step 40",
        "checkpoint model at step 40",
    ]


def test_lines_held_for_a_checkpoint_that_never_comes_are_printed_at_the_end() -> None:
    printed: list[str] = []
    lines = StepOrderedLines([5], printed.append)
    for step in range(1, 8):
        lines.add(step, f"step {step}")
    assert printed == [f"step {step}" for step in range(1, 6)]
    lines.flush()
    assert printed == [f"step {step}" for step in range(1, 8)]


@pytest.mark.parametrize(
    ("training", "due"),
    [
        ({"max_steps": 40, "checkpoint_every_steps": 20}, [20, 40]),
        ({"max_steps": 45, "checkpoint_every_steps": 20}, [20, 40, 45]),
        ({"max_steps": 10}, [10]),
    ],
)
def test_the_checkpoints_a_job_saves(training: dict[str, int], due: list[int]) -> None:
    assert due_checkpoints(training) == due


def test_the_command_to_try_the_model_survives_the_shell_whatever_the_path(tmp_path: Path) -> None:
    """A path with a space and a quote: the shell gives Python the code as written."""
    model = tmp_path / "it's a model"
    words = shlex.split(try_model_command(model, prompt='say "hi"'))
    assert Path(words[0]).name == "python" and words[1] == "-c" and len(words) == 3
    tree = ast.parse(words[2])
    assignments = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    path = next(node.value for node in assignments if ast.unparse(node.targets[0]) == "path")
    assert ast.literal_eval(path) == str(model)
    assert 'say "hi"' in {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
