"""Execution: the Celery task, the DeepSpeed launcher, the training entrypoint and ingestion."""
