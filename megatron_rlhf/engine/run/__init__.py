"""The run around the steps: build, memory plan, checkpoints, evaluation, export (README.md)."""
