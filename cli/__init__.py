"""The ``tuneq`` command: ``main`` (the Typer app: serve, worker, dev, migrate, keys, build-ops),
``client`` (the HTTP client and its commands: submit, jobs, show, logs, cancel, download),
``demo`` (``tuneq demo``) and ``samples`` (a tiny local model and dataset). It may import
``api`` and ``worker``; nothing imports it."""
