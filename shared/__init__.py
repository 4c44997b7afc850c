"""What the API and the worker both import: ``settings``, ``queue`` (the Celery app),
``logging_config``, ``ports``, and by concept ``db/``, ``jobs/``, ``deepspeed/`` and ``data/``.

Nothing here imports torch, DeepSpeed or transformers at module import time: the API must
start fast and small. DeepSpeed's config parser is imported lazily, on the first validation.
"""
