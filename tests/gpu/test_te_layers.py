"""Transformer Engine next to megatron's local layers on one CUDA device, as a PPO run mixes them
(a TE trainer, a local shadow): refit, forward and checkpoints across the two implementations.

Skipped without CUDA and an importable Transformer Engine. On CPU the same paths run against a
local model given TE's parameter layout (``tests/refit/test_layer_implementations.py``,
``tests/models/test_layer_names.py``); this is where the real TE modules take part.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.models.gpt import transformer_engine_importable
from tests.multirank import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not transformer_engine_importable(), reason="needs Transformer Engine")]


def _te_against_local(checkpoint_dir: str) -> dict[str, object]:
    import torch

    from megatron_rlhf.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import gather_full_state, init_weights
    from megatron_rlhf.refit import ModelLayout, build_weight_sync
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from tests.helpers.models import full_logits
    from tests.model_fixtures import TinyArch, whole_world_groups

    initialize_runtime()
    pgc, arch = whole_world_groups(1, 1), TinyArch(num_layers=2)

    def build(impl: str, seed: int):
        options = ModelBuildOptions(transformer_impl=impl, params_dtype="float32",
                                    packed_sequences=False)
        model = build_gpt_model(arch, options, pgc)
        init_weights(model, pgc, seed=seed)
        with torch.no_grad():  # norms away from ones, so a norm lost on the way shows
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
        return model

    def same(a, b) -> bool:
        left, right = gather_full_state(a, pgc), gather_full_state(b, pgc)
        return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)

    trainer, shadow = build("transformer_engine", 1), build("local", 2)
    sync = build_weight_sync(trainer, pgc, ModelLayout(0), shadow, pgc, ModelLayout(0),
                             verify="every")
    sync.sync()
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, which TE's attention must honour
    batch = {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}
    gap = (full_logits(trainer, pgc, batch) - full_logits(shadow, pgc, batch))[mask.cuda() > 0]
    save_model_checkpoint(shadow, pgc, str(Path(checkpoint_dir) / "local"), {"role": "actor"})
    into_te = build("transformer_engine", 3)
    load_model_checkpoint(into_te, pgc, str(Path(checkpoint_dir) / "local"))
    save_model_checkpoint(trainer, pgc, str(Path(checkpoint_dir) / "te"), {"role": "actor"})
    into_local = build("local", 4)
    load_model_checkpoint(into_local, pgc, str(Path(checkpoint_dir) / "te"))
    return {"fused": sorted({n.split(".", 3)[-1] for n, _ in trainer.named_parameters()
                             if "layer_norm_" in n}),
            "refit_equal": same(trainer, shadow), "logit_gap": gap.abs().max().item(),
            "local_ckpt_into_te": same(into_te, shadow),
            "te_ckpt_into_local": same(into_local, trainer)}


@pytest.mark.timeout(240)
def test_a_te_trainer_and_a_local_shadow_share_weights_logits_and_checkpoints(tmp_path) -> None:
    result = run_on_ranks(_te_against_local, 1, args=(str(tmp_path),), timeout_s=180,
                          backend="nccl")[0]
    assert result["fused"] == ["mlp.linear_fc1.layer_norm_weight",
                               "self_attention.linear_qkv.layer_norm_weight"], result
    assert result["refit_equal"] and result["local_ckpt_into_te"], result
    assert result["te_ckpt_into_local"], result
    # the same fp32 weights through TE's kernels and the local ones (TF32 matmuls allowed)
    assert result["logit_gap"] < 2e-2, result
