"""The OpenAI-compatible HTTP API over a swarm (``python -m swarm.api``)."""
