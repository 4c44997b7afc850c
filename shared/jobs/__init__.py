"""A job, from request to run: ``spec`` (the body and the spec the ranks get), ``validation``
(submit-time checks), ``hardware`` (what workers offer), ``plan`` (``POST /jobs/plan``),
``run_layout`` (where a run's files live), ``events`` (what rank 0 reports) and ``lora``."""
