"""The OpenAI-compatible API, under ``/v1``: the official ``openai`` SDK pointed at
``http://<tuneq>/v1`` drives tuneq as it would OpenAI. OpenAI's paths, parameters, object shapes
and error envelope (``errors``); behind them the same owners, keys, tables and store as the
native API. ``files`` (routes) and ``files_service`` (what they do) are the Files API; the
fine-tuning jobs will sit beside them the same way.
"""
