"""A role's network, built on its own process groups and initialised layout-independently."""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.weights import init_weights
from megatron_rlhf.topology.models import ArchSpec


def build_model(arch: ArchSpec, options: ModelBuildOptions, pg_collection: ProcessGroupCollection,
                runtime_seed: int, init_seed: int) -> GPTModel:
    """Build this rank's part of a model and give it the weights ``init_seed`` defines, which do
    not depend on TP/PP/DP (so any layout starts from the same network).

    Args:
        runtime_seed: seeds megatron's model-parallel RNG streams (dropout).
        init_seed: seeds the initial weights.
    """
    model = build_gpt_model(arch, options, pg_collection, seed=runtime_seed)
    init_weights(model, pg_collection, seed=init_seed)
    return model
