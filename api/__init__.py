"""The HTTP API: validates and stores jobs, publishes their ids, reads back what workers wrote."""
