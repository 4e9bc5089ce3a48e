"""A pre-training run on the volunteer side: trainable stages, their optimizer and replicas."""
