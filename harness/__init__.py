"""The project's harness: what tests, benchmarks and measurements use to drive real swarms, never imported by the
product (``swarm``, ``peers``: tests/unit/test_layering.py holds it) and not shipped in its wheel
(tests/integration/test_wheel.py holds that).

- ``harness.local_swarm``: the API in a child process, failure drills (``Disturber``);
- ``harness.fork_server``: forks peers from one process that imported everything once (the integration tests');
- ``harness.wan``: a WAN emulator (network namespaces, a user-space router with delays and bandwidths);
- ``harness.perf``: the cost model's calibration probes and its validation against the benchmarks.
- ``harness.fake_hub``: a local server speaking the Hub's file API (what ``HF_ENDPOINT`` takes in tests);
- ``harness.serving_load``, ``harness.sim_servers``: what two benchmarks run besides swarms (streams and their
  statistics; a simulated population of signed volunteers).

Peers on this machine are started by the product's own launcher, ``swarm.launch``."""
