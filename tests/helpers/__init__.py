"""Plain helpers shared by the test suite (fixtures are in ``tests/conftest.py``).

``tests`` is on pytest's ``pythonpath`` (pyproject.toml), so tests import these as ``from helpers.data import
make_cfg``; a subprocess started by a test puts ``TESTS`` on ``sys.path`` first. No test module imports another
test module: whatever two test files share lives here.

* ``faults``: builders of broken inputs (tars, images, JSON, hostile pickles) and ``reason_of``;
* ``synthetic``: the offline corpus and synthetic multimodal records behind the ``tiny_tokenizer`` and
  ``make_dataset`` fixtures;
* ``data``: a small ``PackedMultimodalDataModule`` on such datasets (``make_cfg``, ``make_dm``, ``take``);
* ``training``: the ~80K-parameter model (``MICRO_MODEL``) and in-process training stand-ins;
* ``runs``: ``scripts/train.py`` run as a subprocess on the small demo dataset;
* ``processes``: forked gloo ranks and the shielded DataLoader-worker stand-in.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # tests/
REPO = TESTS.parent  # the checkout: scripts/, configs/, docs/, nanovlm/, benchmarks/
