"""DeepSpeed's optimizer and CPU comm ops: built at install, loaded once by the warm start for its ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shared.jobs.hardware import Hardware
from worker import launcher
from worker.deepspeed_ops import OPS

PROBE = """
import json
import cpuinfo
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.ops.op_builder.builder import OpBuilder
from worker.deepspeed_ops import preload_ops
loaded = preload_ops()
import torch
DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # what a rank with offload_optimizer makes
print(json.dumps({
    "loaded": loaded,
    "modules": sorted(OpBuilder._loaded_ops),
    "cuda": torch.cuda.is_initialized(),
    "cpu_info_asked": cpuinfo.get_cpu_info.cache_info().misses,
}))
"""


def test_the_warm_start_preloads_every_op_for_its_forked_ranks() -> None:
    # In the ranks' environment (TORCH_EXTENSIONS_DIR: where `tuneq build-ops` put them), as the
    # zygote runs it. DeepSpeed's per-process cache of loaded ops is what a forked rank inherits.
    env = launcher.rank_environment(Hardware("cpu", 2), num_ranks=1, worker_pid=os.getpid())
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["loaded"] == list(OPS)
    assert {"cpu_adam", "fused_adam", "deepspeed_shm_comm"} <= set(probe["modules"])
    assert probe["cuda"] is False
    # py-cpuinfo (a subprocess per call) was asked once, not twice per op and once per optimizer.
    assert probe["cpu_info_asked"] == 1
