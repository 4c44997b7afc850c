"""Execution: the Celery task (``tasks``), one job attempt (``runner``), starting ranks
(``launcher``, ``warm_start``), reading what they write into SQL (``ingest``), and the host's
housekeeping. What runs inside the training processes is ``worker/rank/``."""
