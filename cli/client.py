"""What ``cli.demo`` and the API's tests import from ``cli.client``, the module that held the whole
client before it was split by concern: ``cli.api_client`` (the HTTP client), ``cli.live``
(following a job, the progress bars), ``cli.downloads`` (resumable downloads) and
``cli.commands`` (the Typer commands). New code imports from those.
"""

from __future__ import annotations

from cli.api_client import ClientError, ClientSettings, TuneqClient
from cli.live import FollowState, follow_job

__all__ = ["ClientError", "ClientSettings", "FollowState", "TuneqClient", "follow_job"]
