"""Verification on the client: each hop's work run again elsewhere (``verifier``, ``shadow``), verdicts acted on,
accusations published and judged (``trust``), and forwards and backwards drawn for checks (``calls``)."""
