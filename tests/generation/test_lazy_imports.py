"""The generation package imports megatron-core only where a name needs it: its configuration,
sampling functions, outputs and episode loop come without it (a run's configuration, checked by
rank 0 before the other ranks import megatron-core, reads ``GenerationConfig``)."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.helpers.launch import REPO, tool_env


def _megatron_after(statement: str) -> list[str]:
    code = (f"import sys; {statement}; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=tool_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)


def test_the_configuration_and_sampling_import_without_megatron_core() -> None:
    assert _megatron_after("from megatron_rlhf.generation import GenerationConfig, sample_tokens;"
                           " import megatron_rlhf.generation.episodes") == []


def test_the_generator_imports_it_at_first_use() -> None:
    loaded = _megatron_after("from megatron_rlhf.generation import generate_sequences")
    assert "megatron.core" in loaded
