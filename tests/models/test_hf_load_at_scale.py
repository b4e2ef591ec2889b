"""Loading a Hugging Face start on several ranks (2 gloo ranks, the model at PP=2): rank 0
converts while the other waits in the store, not in a collective (a conversion slower than the
world's 3 s timeout completes); each rank reads from the converted file only its own stage's
tensors and ends with the weights a whole-file load gives; a cache directory that a rank does not
see (node-local, as the default under ~/.cache on a multi-node job) is refused on every rank."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import whole_world_groups
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_hf_model

_SIZES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "pad_token_id": 0}


def _short_world_timeout(seconds: float) -> None:
    from megatron_rlhf.runtime.patches import default_group_store

    store, rank, world_size = default_group_store(), dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("short-timeout", store), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=seconds))


def _load(hf_dir: str, root: str) -> dict:
    from safetensors.torch import load_file

    from megatron_rlhf.builder import sources
    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.weights import load_full_state
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    _short_world_timeout(3.0)
    initialize_runtime()
    source = sources.read_source(hf_dir)
    pgc = whole_world_groups(1, 2)
    build = lambda: build_gpt_model(source.description.arch, source.description.build_options(),  # noqa: E731
                                    pgc)
    model, reference = build(), build()
    convert, read = sources.cached_full_state, sources.SafetensorsState.__getitem__
    names: list[str] = []

    def slow_convert(*args, **kwargs):
        time.sleep(5.0)  # longer than the world's timeout
        return convert(*args, **kwargs)

    def counted(self, name):
        names.append(name)
        return read(self, name)

    sources.cached_full_state, sources.SafetensorsState.__getitem__ = slow_convert, counted
    try:
        sources.load_initial_weights({"actor": model}, {"actor": pgc}, ["actor"],
                                     {"actor": source}, f"{root}/cache")
    finally:
        sources.cached_full_state, sources.SafetensorsState.__getitem__ = convert, read
    [entry] = Path(root, "cache").glob("*/full_state.safetensors")
    full = load_file(entry)
    load_full_state(reference, pgc, full, new_head=True)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  reference.state_dict().values(), strict=True)
               if isinstance(a, torch.Tensor))

    os.environ["HOME"] = f"{root}/home-{dist.get_rank()}"  # a node-local default cache
    try:
        sources.load_initial_weights({"actor": model}, {"actor": pgc}, ["actor"],
                                     {"actor": source}, "~/.cache/megatron_rlhf/converted")
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return {"same": same, "read": names, "all": sorted(full), "refused": refused}


@pytest.mark.multirank
@pytest.mark.timeout(210)
def test_hf_start_converted_by_rank_0_read_per_stage_and_cache_checked(tmp_path: Path) -> None:
    make_hf_model(tmp_path / "hf", "LlamaConfig", "LlamaForCausalLM", 3, **_SIZES)
    results = run_on_ranks(_load, world_size=2, args=(str(tmp_path / "hf"), str(tmp_path)),
                           timeout_s=180)
    assert all(result["same"] for result in results), "weights differ from a whole-file load"
    first, last = (set(result["read"]) for result in results)
    assert first and last, "the ranks did not read the converted file tensor by tensor"
    assert all(name.startswith("decoder.layers.0.") for name in first - {
        "embedding.word_embeddings.weight"}), first
    assert all(name.startswith(("decoder.layers.1.", "decoder.final_layernorm", "output_layer"))
               for name in last), last
    assert not first & last, "a tensor was read by both stages"
    assert first | last <= set(results[0]["all"])
    for result in results:
        assert "models.hf_cache_dir=" in result["refused"], result["refused"]
        assert "is not shared: ranks 1 (" in result["refused"], result["refused"]
        assert "tools/convert_hf_to_megatron.py" in result["refused"]
