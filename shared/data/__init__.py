"""Training data: ``records`` (formats and checks), ``preference`` (preference records for DPO, in
OpenAI's and TRL's shapes), ``remote`` (which URIs a job may name, and their content-addressed
download cache), ``tokenized`` (records to token ids, cached) and ``prepared`` (split, packed into
rows, counted in steps: what the run and the plan see)."""
