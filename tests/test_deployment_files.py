"""The compose file and image cannot run here (no Docker engine); check what can be checked."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_wires_the_services_to_the_settings_they_need() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "api", "worker"} <= services.keys()
    for name in ("api", "worker"):
        env = services[name]["environment"]
        assert env["TUNEQ_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["TUNEQ_BROKER_URL"].startswith("redis://redis:")
        assert "runs:/var/lib/tuneq" in services[name]["volumes"]  # the API reads what workers write
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["api"]["command"][:2] == ["tuneq", "serve"]
    assert services["worker"]["command"] == ["tuneq", "worker"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert "gpu" in gpu["capabilities"]


def test_the_image_installs_with_make_install() -> None:
    dockerfile = (ROOT / "Dockerfile.gpu").read_text()
    assert "RUN make install" in dockerfile
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile
