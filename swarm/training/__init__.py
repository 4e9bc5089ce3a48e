"""Pre-training through the swarm: run configs, seeded initialisation, data, the trainer, checkpoints."""
