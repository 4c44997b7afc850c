"""A user's DeepSpeed config: ``config`` (checked with DeepSpeed's own parser), ``auto_values``
(filling ``"auto"`` as the Hugging Face Trainer does) and ``safety`` (keys a stranger's job may
not set)."""
