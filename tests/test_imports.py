"""The API must start fast and small: neither ``api`` nor ``shared`` pulls in torch on import."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "deepspeed", "transformers")


def test_api_and_shared_do_not_import_heavy_libraries() -> None:
    probe = (
        "import sys, pkgutil, importlib, api.main, shared, worker\n"
        "for mod in pkgutil.walk_packages(shared.__path__, 'shared.'):\n"
        "    importlib.import_module(mod.name)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported at module level: {out.stdout.strip()}"
