"""Pre-training from the client side: the trainer that drives a run through the swarm, and the one-process
reference it is compared with. Both use only the client's public API and the shared run code in ``swarm.training``."""
