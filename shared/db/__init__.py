"""The database: ``engine`` (engine, sessions, migrating), ``models`` (tables and public shapes),
``lifecycle`` (every job and worker state change), ``job_events`` (reading events, live
wake-ups), ``api_keys``, and ``migrations/`` (Alembic)."""
