"""Tiny builders that tests and benchmarks share: a random target with the embedded tokenizer
(`target.py`), chat rows and the stage-1 overrides of a test store (`data.py`), a tiny drafter, its
architecture and packed batches (`drafter.py`). Never used by the pipeline; imports the stages, and
neither `tests` nor `bench` (tests/test_layout.py)."""
