"""What the API and the worker both import: settings, tables, the job spec, storage layout.

Nothing here imports torch, DeepSpeed or transformers at module import time: the API must
start fast and small. DeepSpeed's config parser is imported lazily, on the first validation.
"""
