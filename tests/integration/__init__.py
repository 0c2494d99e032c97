"""End-to-end tests. A package, so that `integration/test_demo.py` (the demo trained for real)
and `tests/test_demo.py` (the demo's parts) can share a basename."""
