"""Which packages the wheel holds: the product's, found rather than listed (``swarm``, ``peers`` and everything under
them), and the TOML files of ``configs/`` as the package ``swarm_configs``. Not the harness (``harness/``), the tests
or the scripts: they run from a checkout. Everything else is in setup.cfg."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["swarm", "swarm.*", "peers", "peers.*"]), "swarm_configs"],
    package_dir={"swarm_configs": "configs"},
)
