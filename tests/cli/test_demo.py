"""`tuneq demo`'s own lines (cli/demo.py); the whole demo runs in tests/e2e/test_demo.py."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

from cli.demo import try_model_command


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
