"""What the tests share, in one place: test modules (``test_*.py``) and ``conftest.py`` files import from here and
never from each other, so a test module holds tests and the fixtures only it uses. pytest collects nothing here (no
module is named ``test_*.py``); ``tests/conftest.py`` has pytest rewrite these modules' asserts as a test's.

- ``models``: tiny random models of each family, saved to a folder, and the local Hugging Face run to compare with;
- ``families``: each served family's tiny config, without weights (the family layer's and runtimes' unit tests);
- ``swarms``: real swarms on loopback, the checks every family must pass against a local run, and drills;
- ``records``, ``plans``, ``schemas``: server records and views, one compiled plan of each kind, JSON schemas;
- ``runs``, ``stages``, ``finetune``: the shipped tiny pre-training run, a trainable stage and signed proofs, and
  what the fine-tuning tests compare;
- ``fuzz_cases``, ``fuzz_live``: seeded malformed input (and how many examples a fuzz test draws), and the live fuzzer;
- ``browser``: headless Chromium through Selenium; ``scripts``: a file of ``scripts/`` as a module;
- processes the tests start with ``python -m tests.helpers.NAME``: ``attacker`` (with ``attacker_training``) and
  ``attacker_memory`` (malicious participants), ``liar`` (a lying server), ``false_accuser`` (a client publishing a
  false accusation) and ``idler`` (a child of the fork server's own tests).
"""
