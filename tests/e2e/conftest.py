from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.samples import build_tiny_model
from tests.services import S3_CREDENTIALS, LoopbackS3
from worker import launcher

from .harness import Tuneq

ARTIFACTS_BUCKET = "tuneq-artifacts"


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built() -> None:
    # `make install` compiles DeepSpeed's CPU Adam op (`tuneq build-ops`); this is the same
    # call, a few seconds when it is built, so a job's first step never includes a compile.
    launcher.build_ops(launcher.detect_hardware())


# A test module that runs its jobs on one shared service uses these three fixtures: each module
# gets its own home and service (module scope). A module adds its datasets by overriding
# `home` with a fixture that takes the `home` below and writes into `home / "data"`, and gives
# the service its environment by overriding `service_env`.


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """This module's TUNEQ_HOME, holding the tiny model every job trains at ``data/tiny-gpt-neo``."""
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    home = tmp_path_factory.mktemp(module) / "home"
    build_tiny_model(home / "data" / "tiny-gpt-neo")
    return home


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    """What this module's service has in its environment beyond the tests' own."""
    return {}


@pytest.fixture(scope="module")
def service(home: Path, service_env: dict[str, str]) -> Iterator[Tuneq]:
    """``tuneq dev`` on this module's home, for all of the module's tests."""
    tuneq = Tuneq(home=home, env=service_env).start()
    yield tuneq
    tuneq.stop()


@pytest.fixture(scope="module")
def loopback_s3() -> Iterator[LoopbackS3]:
    """A real S3 endpoint on loopback (moto's server) for this module, with the artifacts bucket."""
    server = LoopbackS3().start()
    server.client().create_bucket(Bucket=ARTIFACTS_BUCKET)
    yield server
    server.stop()


def s3_artifacts_env(server: LoopbackS3, prefix: str) -> dict[str, str]:
    """A service's environment for artifacts in ``s3://tuneq-artifacts/<prefix>`` on ``server``."""
    return {
        **S3_CREDENTIALS,
        "TUNEQ_S3_ENDPOINT_URL": server.endpoint,
        "TUNEQ_ARTIFACTS_URI": f"s3://{ARTIFACTS_BUCKET}/{prefix}",
    }
