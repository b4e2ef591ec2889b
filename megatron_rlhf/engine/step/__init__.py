"""The algorithm's step: experience, advantages, losses and what a step reports (README.md)."""
