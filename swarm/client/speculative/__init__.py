"""Speculative decoding on the client: its loop and accept rules (``loop``), drafters and draft lengths, and
``generate(speculative=...)`` in a session (``speculator``)."""
