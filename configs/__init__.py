"""Model cards and swarm settings (TOML), installed as the package data of ``swarm_configs``."""
