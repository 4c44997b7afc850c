"""The training processes, one per device: the only code that imports torch. ``train`` (the
rank entrypoint), ``batches``, ``model_loading``, ``checkpointing``, ``reporting`` (events and
errors for the worker) and ``zygote`` (the warm start's process that ranks are forked from)."""
