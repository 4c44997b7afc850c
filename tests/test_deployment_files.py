"""docker-compose.yml, Dockerfile.gpu and .env.example cannot run here (no Docker engine).

So these tests check what can be checked without one: the compose file as `docker compose`
would see it after `cp .env.example .env` (interpolated the way compose does), that every
setting is documented and passed, and that the image installs with the Makefile's own steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (ROOT / "docker-compose.yml").read_text()
ENV_EXAMPLE_TEXT = (ROOT / ".env.example").read_text()
DOCKERFILE_TEXT = (ROOT / "Dockerfile.gpu").read_text()

SERVICES = {"postgres", "redis", "minio", "minio-init", "migrate", "api", "worker", "flower"}
TUNEQ_SERVICES = ("migrate", "api", "worker")
# Settings docker-compose.yml sets itself, to its services and volumes: not taken from .env.
WIRED = {"home", "database_url", "broker_url", "allowed_roots"}
# Settings compose points at its own services by default (overridable from .env), with their
# default in compose, which .env.example shows; S3_BUCKET is .env.example's.
COMPOSE_DEFAULTS = {"s3_endpoint_url": "http://minio:9000", "artifacts_uri": "s3://tuneq/runs"}
# Read by the CLI from the environment rather than through Settings.
NON_SETTINGS_TUNEQ_VARS: set[str] = set()
HOME_MOUNT = "/var/lib/tuneq"

# $$ (a literal $), ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME;
# a default may itself interpolate (${A:-s3://${B:-x}/runs}), as Compose v2 allows.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATOR = re.compile(r":?[-?]")
_ASSIGNMENT = re.compile(r"^(?P<commented>#\s*)?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


class MissingVariable(Exception):
    pass


@dataclass(frozen=True)
class Reference:
    """One ${NAME<op><arg>} or $NAME of a compose value; ``arg`` is still to be interpolated."""

    name: str
    op: str | None
    arg: str


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the } that closes a ${ whose operand starts at ``start``, past nested ${...}."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return None


def parse_value(text: str) -> list[str | Reference]:
    """A compose value as literal text and the variable references in it, in order."""
    parts: list[str | Reference] = []
    literal: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            literal.append("$")
            i += 2
            continue
        if text.startswith("${", i) and (name := _NAME.match(text, i + 2)):
            op = _OPERATOR.match(text, name.end())
            operand = op.end() if op else name.end()
            end = _closing_brace(text, operand)
            if end is not None and (op or end == name.end()):
                parts += ["".join(literal), Reference(name.group(), op.group() if op else None, text[operand:end])]
                literal, i = [], end + 1
                continue
        if text[i] == "$" and (name := _NAME.match(text, i + 1)):
            parts += ["".join(literal), Reference(name.group(), None, "")]
            literal, i = [], name.end()
            continue
        literal.append(text[i])
        i += 1
    return [*parts, "".join(literal)]


def references(text: str) -> list[Reference]:
    """Every variable reference of ``text``, those inside a default or an error message included."""
    found = []
    for part in parse_value(text):
        if isinstance(part, Reference):
            found += [part, *references(part.arg)]
    return found


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, for the forms docker-compose.yml uses."""

    def substitute(ref: Reference) -> str:
        value = env.get(ref.name)
        missing = not value if ref.op in (":-", ":?") else value is None
        if not missing:
            return value or ""
        if ref.op in (":?", "?"):
            raise MissingVariable(f"{ref.name}: {interpolate(ref.arg, env)}")
        if ref.op in (":-", "-"):
            return interpolate(ref.arg, env)
        return ""

    return "".join(part if isinstance(part, str) else substitute(part) for part in parse_value(text))


def interpolated_names(text: str) -> set[str]:
    return {ref.name for ref in references(text)}


def env_example_assignments(*, commented: bool) -> dict[str, str]:
    """The NAME=value lines of .env.example: the active ones, or the commented-out ones."""
    found = {}
    for line in ENV_EXAMPLE_TEXT.splitlines():
        match = _ASSIGNMENT.match(line.strip())
        if match and bool(match.group("commented")) == commented:
            found[match.group("name")] = match.group("value")
    return found


def documented_names() -> set[str]:
    return env_example_assignments(commented=False).keys() | env_example_assignments(commented=True).keys()


def setting_var(field: str) -> str:
    return f"TUNEQ_{field.upper()}"


# What an operator fills in before the first `docker compose up`.
FILLED_SECRETS = {
    "POSTGRES_PASSWORD": "pg-secret-1234",
    "REDIS_PASSWORD": "redis-secret-1234",
    "MINIO_ROOT_PASSWORD": "minio-secret-1234",
    "AWS_SECRET_ACCESS_KEY": "s3-secret-1234",
    "FLOWER_BASIC_AUTH": "admin:flower-secret",
}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return {**env_example_assignments(commented=False), **FILLED_SECRETS}


def load_compose(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml as compose sees it: parsed, then each string value interpolated."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        return interpolate(node, env) if isinstance(node, str) else node

    compose: dict[str, Any] = walk(yaml.safe_load(COMPOSE_TEXT))
    return compose


@pytest.fixture(scope="module")
def compose(env: dict[str, str]) -> dict[str, Any]:
    return load_compose(env)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    services: dict[str, Any] = compose["services"]
    return services


def settings_from(environment: dict[str, str]) -> Settings:
    fields = {
        name.removeprefix("TUNEQ_").lower(): value
        for name, value in environment.items()
        if name.startswith("TUNEQ_") and name.removeprefix("TUNEQ_").lower() in Settings.model_fields
    }
    return Settings.model_validate(fields)


def test_compose_has_the_services_the_docs_name(services: dict[str, Any]) -> None:
    assert services.keys() == SERVICES
    guide = (ROOT / "docs" / "deploying.md").read_text()
    compose = guide.split("\n## One host: Docker Compose\n", 1)[1].split("\n## ", 1)[0]
    for name in SERVICES:
        assert f"`{name}`" in compose, f"docs/deploying.md's Docker Compose section does not name the {name} service"


def test_the_tuneq_processes_get_every_setting_and_reach_the_compose_services(
    services: dict[str, Any], env: dict[str, str]
) -> None:
    for name in TUNEQ_SERVICES:
        environment = services[name]["environment"]
        for field in Settings.model_fields:
            assert setting_var(field) in environment, f"{name} does not get {setting_var(field)}"
        db = make_url(environment["TUNEQ_DATABASE_URL"])
        assert (db.drivername, db.host, db.port) == ("postgresql+psycopg", "postgres", 5432)
        assert (db.username, db.password, db.database) == (
            env["POSTGRES_USER"],
            env["POSTGRES_PASSWORD"],
            env["POSTGRES_DB"],
        )
        assert environment["TUNEQ_BROKER_URL"] == f"redis://:{env['REDIS_PASSWORD']}@redis:6379/0"
        assert environment["TUNEQ_HOME"] == HOME_MOUNT
        settings = settings_from(environment)
        assert not settings.uses_embedded_database and not settings.uses_embedded_broker
    postgres = services["postgres"]["environment"]
    assert (postgres["POSTGRES_USER"], postgres["POSTGRES_DB"]) == (env["POSTGRES_USER"], env["POSTGRES_DB"])
    assert services["migrate"]["command"] == ["tuneq", "migrate"]
    assert services["api"]["command"][:4] == ["tuneq", "serve", "--host", "0.0.0.0"]
    assert services["worker"]["command"] == ["tuneq", "worker"]
    # One image, built by the same Dockerfile, for all three.
    images = {(services[n]["image"], services[n]["build"]["dockerfile"]) for n in TUNEQ_SERVICES}
    assert images == {(env["APP_IMAGE"], "Dockerfile.gpu")}


def test_compose_defaults_are_the_code_defaults(services: dict[str, Any]) -> None:
    """A setting left commented in .env gets the same value in compose as without compose."""
    environment = services["worker"]["environment"]
    for field, info in Settings.model_fields.items():
        if field in WIRED:
            continue
        value = getattr(Settings.model_validate({field: environment[setting_var(field)]}), field)
        expected = COMPOSE_DEFAULTS.get(field, info.default)
        assert value == expected, f"compose passes {setting_var(field)}={value!r}, the code default is {expected!r}"


def test_the_worker_has_the_gpus_shared_memory_locked_memory_and_s3(
    services: dict[str, Any], env: dict[str, str]
) -> None:
    worker = services["worker"]
    gpu = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    size = re.fullmatch(r"(\d+)\s*gb?", str(worker["shm_size"]).lower())
    assert size and int(size.group(1)) >= 8, f"shm_size {worker['shm_size']} is too small for NCCL and DataLoaders"
    assert worker.get("ipc") != "host"  # ipc: host would ignore shm_size
    assert worker["ulimits"]["memlock"] == -1
    init = services["minio-init"]["environment"]
    assert init["S3_BUCKET"] == env["S3_BUCKET"]
    assert "mc mb --ignore-existing" in services["minio-init"]["command"][0]
    # The API streams downloads from the store (and plans read s3:// datasets), the worker
    # publishes to it: both sign with the S3 user minio-init creates, on compose's MinIO.
    for name in ("api", "worker"):
        environment = services[name]["environment"]
        assert environment["TUNEQ_S3_ENDPOINT_URL"] == "http://minio:9000", name
        assert environment["AWS_ACCESS_KEY_ID"] == init["S3_ACCESS_KEY_ID"] == env["AWS_ACCESS_KEY_ID"], name
        assert environment["AWS_SECRET_ACCESS_KEY"] == init["S3_SECRET_ACCESS_KEY"] == env["AWS_SECRET_ACCESS_KEY"]
        assert environment["AWS_DEFAULT_REGION"] == env["AWS_DEFAULT_REGION"], name
    # The migration touches no store: it gets no S3 secret.
    assert "AWS_SECRET_ACCESS_KEY" not in services["migrate"]["environment"]


def test_artifacts_go_to_minios_bucket_and_api_and_worker_share_no_state_volume(
    compose: dict[str, Any], services: dict[str, Any], env: dict[str, str]
) -> None:
    bucket = services["minio-init"]["environment"]["S3_BUCKET"]
    for name in TUNEQ_SERVICES:
        settings = settings_from(services[name]["environment"])
        assert settings.artifacts_uri == f"s3://{bucket}/runs", name
        assert settings.s3_endpoint_url == "http://minio:9000", name
    # The bucket follows S3_BUCKET, and .env may name another store.
    moved = load_compose({**env, "S3_BUCKET": "models"})["services"]
    assert moved["worker"]["environment"]["TUNEQ_ARTIFACTS_URI"] == "s3://models/runs"
    assert moved["minio-init"]["environment"]["S3_BUCKET"] == "models"
    elsewhere = load_compose({**env, "TUNEQ_ARTIFACTS_URI": "s3://elsewhere/tuneq"})["services"]
    assert {elsewhere[n]["environment"]["TUNEQ_ARTIFACTS_URI"] for n in TUNEQ_SERVICES} == {"s3://elsewhere/tuneq"}

    def mounts(name: str) -> dict[str, str]:
        return {volume.split(":")[0]: volume for volume in services[name].get("volumes", [])}

    api, worker = mounts("api"), mounts("worker")
    # No named volume in both; the only common mount is the read-only input directory.
    for source in api.keys() & worker.keys():
        assert source.startswith((".", "/")) and api[source].endswith(":ro"), f"api and worker share {api[source]}"
    assert worker["worker-home"] == f"worker-home:{HOME_MOUNT}"  # the worker's cache
    assert api["api-home"] == f"api-home:{HOME_MOUNT}"  # the API's own (plans' datasets, `serve`'s runs dir)
    assert "runs" not in compose["volumes"]
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert "miniodata:/data" in services["minio"]["volumes"]
    assert {"pgdata", "miniodata", "worker-home"} <= compose["volumes"].keys()


def test_services_wait_on_healthchecks_and_on_the_one_shot_jobs(services: dict[str, Any]) -> None:
    for name in ("postgres", "redis", "minio", "api"):
        assert services[name]["healthcheck"]["test"], f"{name} has no healthcheck"
    expected = {
        "migrate": {"postgres": "service_healthy"},
        "minio-init": {"minio": "service_healthy"},
        "api": {
            "postgres": "service_healthy",
            "redis": "service_healthy",
            "minio": "service_healthy",
            "migrate": "service_completed_successfully",
            "minio-init": "service_completed_successfully",
        },
        "worker": {
            "postgres": "service_healthy",
            "redis": "service_healthy",
            "minio": "service_healthy",
            "migrate": "service_completed_successfully",
            "minio-init": "service_completed_successfully",
        },
        "flower": {"redis": "service_healthy"},
    }
    for name, dependencies in expected.items():
        got = {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()}
        assert got == dependencies, name
    for name, service in services.items():
        for dep, spec in service.get("depends_on", {}).items():
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"
    for name in ("migrate", "minio-init"):
        assert services[name]["restart"] == "no"


def test_flower_watches_the_workers_broker(services: dict[str, Any]) -> None:
    flower = services["flower"]
    assert flower["image"].startswith("mher/flower:")
    assert flower["environment"]["CELERY_BROKER_URL"] == services["worker"]["environment"]["TUNEQ_BROKER_URL"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == FILLED_SECRETS["FLOWER_BASIC_AUTH"]


def test_every_variable_compose_interpolates_is_in_env_example() -> None:
    missing = interpolated_names(COMPOSE_TEXT) - documented_names()
    assert not missing, f"docker-compose.yml reads {sorted(missing)}, which .env.example does not list"


def test_every_setting_is_in_env_example_with_its_default() -> None:
    documented = documented_names()
    for field in Settings.model_fields:
        assert setting_var(field) in documented, f"{setting_var(field)} (shared/settings.py) is not in .env.example"
    stale = {n for n in documented if n.startswith("TUNEQ_")} - {setting_var(f) for f in Settings.model_fields}
    assert stale <= NON_SETTINGS_TUNEQ_VARS, f".env.example lists {sorted(stale)}, which are no settings"
    commented = env_example_assignments(commented=True)
    for field, info in Settings.model_fields.items():
        if field in WIRED:
            continue
        value = getattr(Settings.model_validate({field: commented[setting_var(field)]}), field)
        expected = COMPOSE_DEFAULTS.get(field, info.default)
        assert value == expected, f".env.example shows {setting_var(field)}={value!r}, the default is {expected!r}"
    # Each documented variable has its one-line comment right above it.
    lines = ENV_EXAMPLE_TEXT.splitlines()
    for i, line in enumerate(lines):
        if _ASSIGNMENT.match(line.strip()):
            above = lines[i - 1].strip()
            assert above.startswith("#") and not _ASSIGNMENT.match(above), f"no comment above {line!r}"


def test_the_untouched_env_example_has_no_secrets_and_compose_refuses_it() -> None:
    active = env_example_assignments(commented=False)
    for name in FILLED_SECRETS:
        assert active[name] == "", f"{name} has a placeholder value in .env.example: leave it empty"
    with pytest.raises(MissingVariable):
        load_compose(active)
    required = {ref.name for ref in references(COMPOSE_TEXT) if ref.op == ":?"}
    assert required <= active.keys()


def _dockerfile_instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE_TEXT)
    instructions = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            instructions.append((keyword.upper(), rest))
    return instructions


def test_the_image_installs_with_make_install_and_runs_as_a_user() -> None:
    instructions = _dockerfile_instructions()
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    installs = [run for run in runs if "make install" in run]
    assert len(installs) == 1, "the image must install with `make install`, the target CI runs"
    assert not any("pip install" in run for run in runs), "pip installs belong in the Makefile, not the image"
    for flag in ("DS_ACCELERATOR=cuda", "DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "TORCH_CUDA_ARCH_LIST="):
        assert flag in installs[0], f"DeepSpeed's ops are built at install time: {flag} is missing"
    users = [rest.strip() for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert [keyword for keyword, _ in instructions].index("USER") > max(
        i for i, (keyword, _) in enumerate(instructions) if keyword == "RUN"
    )


def test_the_images_cuda_is_the_one_of_the_makefiles_torch() -> None:
    """The CUDA base was chosen for the Makefile's torch: a torch bump must revisit it."""
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH\s*\?=\s*(\S+)", makefile, re.MULTILINE)
    assert torch and torch.group(1) == "torch==2.13.0"
    assert torch.group(1) in DOCKERFILE_TEXT
    base = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+\.\d+)\.\d+-devel-", DOCKERFILE_TEXT, re.MULTILINE)
    assert base and base.group(1) == "13.0", "torch 2.13.0's PyPI wheel is a CUDA 13.0 build"
    assert "python3.11 -m venv" in DOCKERFILE_TEXT


def test_secrets_and_local_state_stay_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".env", ".venv", ".git", ".tuneq"} <= ignored
    assert not ignored & {"Makefile", "pyproject.toml", "README.md"}  # what `make install` reads


def test_the_tests_interpolate_as_compose_does() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("a${SET}b$SET$$SET", env) == "axbx$SET"
    assert interpolate("${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET}", env) == "d  d "
    assert interpolate("${UNSET:-s3://${SET:-y}/runs}|${SET:-s3://${UNSET:-y}/runs}", env) == "s3://x/runs|x"
    assert interpolate("${UNSET:-s3://${UNSET:-y}/runs}", env) == "s3://y/runs"
    with pytest.raises(MissingVariable):
        interpolate("${EMPTY:?set it}", env)
    assert interpolated_names("${A:-${B:-${C}}/x} $$D $E") == {"A", "B", "C", "E"}
