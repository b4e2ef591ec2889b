"""Test support, apart from the product as ``torch.testing`` is: emulations of what CPU lacks
and hooks into a run that only tests and checks use (map in ``README.md``).

Production code imports nothing from here, except behind a test switch read from the
environment, inside the function that acts on it (``tests/test_layering.py`` checks it).
"""
