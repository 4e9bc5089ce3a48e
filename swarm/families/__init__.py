"""The family layer: what differs between the decoder-only families the swarm serves, shared by servers and clients.

A family is found from the config's architecture (the causal-LM class and the modeling module defining it), never
from the model type's name (``spec``). Per family it says where the layers live and how they are named on disk
(``weights``), what the client computes before and after the layers (``local``), what a server's span feeds each
layer on every call (``span``), how many cache bytes a token costs (``kv``), and it proves at start-up that the
split path equals Hugging Face's own forward on a shrunk twin of the config, or refuses (``selfcheck``).

Importing this package imports nothing heavy: each module imports torch and transformers itself."""
