"""Fixtures shared by the data-layer tests: one tokenizer trained on the shipped corpus."""

from __future__ import annotations

import pytest

from megatron_rlhf.models.tokenizer import SHIPPED_CORPUS, Tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A 512-piece tokenizer trained on the shipped corpus (about 0.1 s)."""
    out = tmp_path_factory.mktemp("tokenizer") / "spm.model"
    return Tokenizer.train(SHIPPED_CORPUS, 512, out)
