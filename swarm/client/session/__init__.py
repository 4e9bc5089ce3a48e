"""An inference session: the client's side of a decode step, hop state by hop state (``docs/layout.md`` walks it)."""
