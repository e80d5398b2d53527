"""Runnable examples (`python -m examples.<name>` from the repository root); each exposes
`main(argv)`, which tests/test_examples.py runs at toy size."""
