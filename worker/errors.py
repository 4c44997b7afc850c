class InvalidInputError(Exception):
    """The job's own inputs (data, model, config) are wrong; retrying will not help."""
