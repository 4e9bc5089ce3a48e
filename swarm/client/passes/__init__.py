"""Forward and backward passes through servers (fine-tuning, scoring, pre-training): client-mediated with failover as
plan repair (``sequential``), chained from stage to stage (``chained``), and one call's chain as it runs
(``chain_run``)."""
