"""All tuneq settings, read from the environment (prefix ``TUNEQ_``) in one place."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# TUNEQ_MAX_LINE_BYTES's default, which the spec handed to the ranks also falls back on. 8 MiB: a
# million-token conversation is about 4 MB of JSON (~4 bytes a token), and one written with
# \uXXXX escapes (json.dumps' default for non-ASCII text) under 8; a 128k-token one under 1 MB.
# Parsing a line takes about twice its size for long strings, and up to ~25 times (~200 MB) for a
# line of tiny objects, which is what this bounds per upload or dataset read in flight.
DEFAULT_MAX_LINE_BYTES = 8 * 1024**2

# The most API processes `tuneq serve` starts by default (TUNEQ_API_WORKERS=0): past a few, a
# host's cores are better spent on Postgres and the workers, and each process holds ~360 MB and
# its own database pool.
MAX_DEFAULT_API_WORKERS = 4


class Settings(BaseSettings):
    """Every knob of the service. Defaults give the embedded, no-services setup."""

    model_config = SettingsConfigDict(env_prefix="TUNEQ_", extra="ignore")

    home: Path = Field(default=Path("./.tuneq"), description="State directory; runs live in home/runs/<id>.")
    database_url: str = Field(default="", description="SQLAlchemy URL; default SQLite under home.")
    broker_url: str = Field(default="", description="Celery broker URL; default a SQLite broker under home.")
    allowed_roots: str = Field(
        default="", description="os.pathsep-separated directories local models and datasets may come from."
    )
    # Comma-separated models (hub ids, local directories) this deployment offers: GET /v1/models
    # lists them and jobs may train only them. Empty: any model, and /v1/models lists the model
    # directories directly under the allowed roots.
    base_models: str = ""
    # How long a worker may go unseen before the API stops counting it when it decides what
    # hardware the deployment has (fp16 needs CUDA).
    worker_seen_seconds: int = 120
    # Training-log lines the API returns at most for one /logs request.
    max_log_tail: int = 10_000
    # The prefix of the broker's queues: one per worker size (`tuneq-2dev`, shared.queue.size_queue)
    # and one per worker for the nodes of multi-node jobs placed on it (`tuneq-node-<worker>`).
    queue: str = "tuneq"
    # A running job's lease; a worker renews it every third of this. Expired: the worker is lost.
    lease_ttl_seconds: float = 60.0
    # After SIGTERM to a cancelled job's ranks, how long rank 0 may take to finish its step.
    cancel_grace_seconds: float = 30.0
    # On SIGTERM, how long `tuneq serve` lets the requests in flight finish (a plan may take
    # minutes); those still running then are answered 503 with Retry-After. Keep it under the
    # time the process manager waits before SIGKILL (Docker's stop grace, Kubernetes'
    # terminationGracePeriodSeconds), less a few seconds for the plan child to be stopped.
    api_stop_grace_seconds: int = Field(default=10, ge=0)
    # API processes `tuneq serve` runs on its one port (api.server_processes), each with its own
    # event loop, read cache, plan child and database pool (up to 30 connections each); 1: one
    # process. 0: the cores this process may run on, at most MAX_DEFAULT_API_WORKERS
    # (``api_worker_count``). `tuneq serve --workers N` overrides it.
    api_workers: int = Field(default=0, ge=0)
    # How often each worker's reconciler looks for lost jobs and unpublished queued ones.
    reconcile_seconds: float = 10.0
    # A queued job nobody claimed for this long is published again (the broker may have lost it).
    republish_after_seconds: float = 60.0
    # Redis redelivers a message not acked within this; jobs run for hours, and a redelivery
    # of a claimed job is a no-op anyway, so the default is long.
    redis_visibility_timeout_seconds: int = 7 * 24 * 3600
    # Remote datasets (shared.data.remote). Comma-separated hosts https:// datasets may come
    # from: "data.example.com" (port 443 only), "data.example.com:8443", "*.example.com" (any
    # subdomain, not the apex). Empty: no https:// datasets at all.
    allowed_https_hosts: str = ""
    # Comma-separated CIDRs that https:// dataset hosts may resolve to although not public
    # (e.g. "10.20.0.0/16"); link-local and cloud metadata addresses stay refused regardless.
    allowed_private_networks: str = ""
    # A PEM file of extra CA certificates for https:// datasets, trusted besides the system's.
    ca_bundle: str = ""
    # S3 endpoint for s3:// datasets (MinIO, another S3 store); empty: AWS. Credentials come
    # from the usual AWS variables and files.
    s3_endpoint_url: str = ""
    # The Hugging Face Hub (or a mirror) that hf://datasets/... URIs are read from; HF_TOKEN
    # applies to it.
    hf_endpoint: str = "https://huggingface.co"
    # The largest remote dataset a worker downloads.
    max_dataset_bytes: int = 10 * 1024**3
    # API keys (``Authorization: Bearer``): "on", "off" (every job belongs to owner "local"; only
    # when the API listens on loopback), or "auto": `tuneq serve`/`dev` turn it off on a loopback
    # --host and on otherwise; an app served any other way requires keys.
    auth: Literal["auto", "on", "off"] = "auto"
    # Queued, running, pausing and cancelling jobs one owner may have at once (0: no limit); past it a
    # submit or a resume is 429. Paused jobs do not count.
    max_active_jobs_per_owner: int = Field(default=8, ge=0)
    # The largest request body the API reads; past it 413, before the body is parsed.
    max_request_bytes: int = Field(default=1024**2, ge=1)
    # The largest file POST /v1/files takes (OpenAI's limit for a fine-tuning file, 512 MiB);
    # past it 413. The upload is spooled to disk as it arrives, so this bounds disk, not memory.
    max_upload_bytes: int = Field(default=512 * 1024**2, ge=1)
    # The longest line of a JSON Lines file (a /v1/files upload, a dataset read at submit, plan or
    # by the worker); past it a 4xx naming the line. Files are read a line at a time, and a longer
    # line is never held whole, so this bounds the memory one file's check takes.
    max_line_bytes: int = Field(default=DEFAULT_MAX_LINE_BYTES, ge=1)
    # Memory of one device, which the DeepSpeed config tuneq chooses for a job without one is
    # planned for (shared.deepspeed.chosen) while no live worker that could run the job has
    # recorded its own (none seen yet, or rows of workers from an older release): a GPU's on
    # CUDA workers (80: an A100 or H100 80GB), a rank's share of host memory on CPU workers.
    device_memory_gib: float = Field(default=80.0, gt=0)
    # Logs of `tuneq serve`, `worker` and `dev` on stderr: "text" for people, "json" (one object
    # per line) for a log collector. Training logs in the run directory stay text either way.
    log_format: Literal["text", "json"] = "text"
    # How a worker starts a job's ranks: "warm" forks them from a process that imported torch,
    # DeepSpeed and transformers while the worker was idle (worker.rank.zygote; the first step
    # comes about 10 s sooner); "deepspeed" runs DeepSpeed's own launcher for every job. A
    # worker whose warm start cannot come up uses the launcher anyway.
    launcher: Literal["warm", "deepspeed"] = "warm"
    # GET /jobs/{id} answers from what this API process read at most this many seconds ago
    # (api.read_cache): pollers of one job share a read instead of each querying the database.
    # A change made by a worker or another API replica shows within it; 0: read every time.
    job_cache_seconds: float = Field(default=1.0, ge=0)
    # Likewise for the look-up of a request's API key: a key revoked with `tuneq keys revoke`
    # gets 401 from every API process within this many seconds; 0: look it up every time.
    key_cache_seconds: float = Field(default=1.0, ge=0)
    # A worker takes no job while the disk holding TUNEQ_HOME has less free space than this
    # (checkpoints and exports are written there): it says why in its log, in its `workers`
    # row and on /metrics, and takes jobs again once space is back. 0: never check.
    min_free_disk_mb: int = Field(default=2048, ge=0)
    # Log level of `tuneq serve`, `worker` and `dev` (`DEBUG` ... `CRITICAL`, any case).
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    # Where checkpoints, exported models, adapters and training logs live (shared.artifacts):
    # "s3://bucket/prefix" on any S3 store (TUNEQ_S3_ENDPOINT_URL, credentials from the AWS
    # chain), or a local or mounted directory. Empty: TUNEQ_HOME/runs, where the ranks write
    # them, so a single host stores nothing twice.
    artifacts_uri: str = ""
    # On: GET /jobs/{id}/artifacts/{path} on an S3 store answers with a redirect to a URL
    # presigned for artifacts_presign_seconds. Off: the API streams the file (clients often
    # cannot reach the store).
    artifacts_presign: bool = False
    # How long a presigned download URL is valid (at most 604800, 7 days).
    artifacts_presign_seconds: int = Field(default=300, ge=1, le=7 * 24 * 3600)
    # The longest store outage a worker rides out, retrying uploads (mid-run the ranks go on up
    # to their next save); past it the job fails with artifact_store_unavailable, its local
    # files kept on the worker.
    artifact_upload_deadline_seconds: float = Field(default=600.0, ge=0)
    # Multi-node jobs (shared.db.gangs). The address the other nodes of a job reach this
    # worker's ranks at: empty, the host's primary address (that of its default route).
    worker_address: str = ""
    # Rendezvous ports (MASTER_PORT) a gang's node 0 listens on, "first-last": open them
    # between the worker hosts.
    gang_ports: str = Field(default="29500-29999", pattern=r"^\d{1,5}-\d{1,5}$")
    # A placed gang whose every node has not started within this is released whole and retried.
    gang_start_seconds: float = Field(default=120.0, gt=0)
    # A rank that shows no sign of life for this long (stopped, or stuck outside a collective
    # with the GIL held) fails its node, and with it the gang; a rank waiting in a collective
    # still shows life. The bound on noticing a frozen or lost node is this plus a lease renewal.
    rank_stall_seconds: float = Field(default=30.0, gt=0)
    # The network interface NCCL and gloo use between nodes (NCCL_SOCKET_IFNAME,
    # GLOO_SOCKET_IFNAME); empty: their own choice.
    socket_ifname: str = ""
    # DeepSpeed's collective timeout, in minutes (`deepspeed.init_distributed(timeout=...)`; its
    # default, 30: a long save on one rank keeps the others waiting in a barrier; a stopped rank
    # is caught by TUNEQ_RANK_STALL_SECONDS long before).
    dist_timeout_minutes: int = Field(default=30, ge=1)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.home = self.home.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'tuneq.sqlite'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.home / 'broker.sqlite'}"
        if not self.allowed_roots:
            self.allowed_roots = str(self.home / "data")
        if not self.artifacts_uri:
            self.artifacts_uri = str(self.runs_dir)
        return self

    @property
    def gang_port_range(self) -> tuple[int, int]:
        first, _, last = self.gang_ports.partition("-")
        return int(first), int(last)

    @property
    def api_worker_count(self) -> int:
        """The API processes `tuneq serve` runs: TUNEQ_API_WORKERS, or for 0 the cores this process
        may run on, at most MAX_DEFAULT_API_WORKERS."""
        if self.api_workers:
            return self.api_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, MAX_DEFAULT_API_WORKERS))

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def cache_dir(self) -> Path:
        """Downloads and tokenized datasets, keyed by content, shared by the jobs of a host."""
        return self.home / "cache"

    @property
    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gib * 2**30)

    @property
    def base_model_list(self) -> list[str]:
        return [m.strip() for m in self.base_models.split(",") if m.strip()]

    @property
    def allowed_root_paths(self) -> list[Path]:
        return [Path(p).expanduser().resolve() for p in self.allowed_roots.split(os.pathsep) if p]

    @property
    def auth_required(self) -> bool:
        """Whether the API asks for an API key. `tuneq serve` resolves "auto" from its --host first."""
        return self.auth != "off"

    @property
    def uses_embedded_database(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def uses_embedded_broker(self) -> bool:
        return self.broker_url.startswith("sqla+sqlite")

    def ensure_dirs(self) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        for root in self.allowed_root_paths:
            if root.is_relative_to(self.home):
                root.mkdir(parents=True, exist_ok=True)


@lru_cache
def get_settings() -> Settings:
    return Settings()
