"""The software version a peer announces and a wheel is built as (its own module, so that any layer can read it
without importing the ``swarm`` facade, which re-exports the client)."""

__version__ = "0.1.0"
