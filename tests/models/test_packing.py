"""Packed sequences (THD) against the padded forward, in one process on CPU.

The packed forward computes no padding; every real token's output, and the gradients of a loss
over real tokens, must equal the padded forward's within fp32 rounding, for every head, for left
and right padding, GQA and the Hugging Face numerics options.
"""

from __future__ import annotations

import os
import sys
from itertools import pairwise

import pytest
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from megatron_rlhf.models.forward_backward import run_microbatches
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.packing import pack_rows, packed_length
from megatron_rlhf.models.weights import init_weights
from tests.model_fixtures import TinyArch, whole_world_groups

# Left-padded prompts with right-padded responses, a row without padding, a right-padded row.
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0],
                     [1, 1, 1, 1, 1, 1, 1, 1, 1],
                     [0, 1, 1, 1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def groups():
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return whole_world_groups(1, 1)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 250, MASK.shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids * MASK, "attention_mask": MASK.clone()}


def test_pack_rows_lays_real_tokens_back_to_back_and_unpack_restores_them() -> None:
    batch = _batch()
    packed = pack_rows(batch["input_ids"], batch["attention_mask"], length=26)
    real = int(MASK.sum())
    assert real == 21
    assert packed.input_ids.shape == (1, 26)
    assert torch.equal(packed.input_ids[0, :real], batch["input_ids"][MASK.bool()])
    assert packed.params.cu_seqlens_q.tolist() == [0, 5, 14, 18, 21, 26], "the tail is one more"
    assert packed.params.max_seqlen_q == 9
    assert packed.position_ids[0].tolist() == [*range(5), *range(9), *range(4), *range(3),
                                               *range(5)]
    unpacked = packed.unpack(packed.input_ids[..., None].float())[..., 0]
    assert torch.equal(unpacked, batch["input_ids"].float())
    assert packed_length([MASK, MASK[:2]], multiple=4) == 24
    assert packed_length([MASK[2:]]) == 7
    with pytest.raises(ValueError, match="21 real tokens do not fit a packed row of 20"):
        pack_rows(batch["input_ids"], batch["attention_mask"], length=20)
    holey = torch.tensor([[1, 0, 1]])
    with pytest.raises(ValueError, match="models.packed_sequences=false"):
        pack_rows(holey, holey, length=3)


def _outputs_and_grads(options: ModelBuildOptions, arch, groups, microbatches):
    model = build_gpt_model(arch, options, groups)
    init_weights(model, groups, seed=5)
    outputs = []

    def loss_fn(output, batch):
        outputs.append(output.detach())
        real = batch["attention_mask"].bool()
        weights = torch.linspace(0.5, 1.5, output.shape[-1])
        return (output[real].float() * weights).sin().sum(), {}

    run_microbatches(model, groups, microbatches, loss_fn, forward_only=False)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return outputs, grads


@pytest.mark.parametrize("head", ["lm", "scalar", "lm+scalar"])
@pytest.mark.parametrize("numerics", [{}, {"qkv_bias": True, "qk_norm": True}])
def test_packed_forward_and_gradients_equal_the_padded_ones(groups, head, numerics) -> None:
    arch = TinyArch(num_attention_heads=4, num_query_groups=2, **numerics)
    microbatches = [_batch(0), _batch(1)]
    results = {}
    for packed in (False, True):
        options = ModelBuildOptions(head=head, params_dtype="float32", packed_sequences=packed)
        results[packed] = _outputs_and_grads(options, arch, groups, microbatches)
    real = MASK.bool()
    for padded_out, packed_out in zip(results[False][0], results[True][0], strict=True):
        torch.testing.assert_close(packed_out[real], padded_out[real], rtol=1e-5, atol=1e-5)
        assert not packed_out[~real].any(), "padding positions hold no output"
    for name, grad in results[False][1].items():
        # fp32 sums in another order: tolerance relative to the gradient's scale
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4,
                                   atol=1e-5 * float(grad.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_packing_needs_attention_that_takes_boundaries() -> None:
    with pytest.raises(ValueError, match="set packed_sequences=false"):
        ModelBuildOptions(attention_backend="megatron")
    assert not ModelBuildOptions(attention_backend="megatron",
                                 packed_sequences=False).packed_sequences


def test_packed_rope_is_applied_at_the_batchs_positions_without_megatrons_thd_path(
        groups, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's unfused THD RoPE reads the sequence lengths back to the host for the queries
    and the keys of every layer; the positions computed once per batch replace it, with the
    same outputs (the test above)."""
    from megatron.core.models.common.embeddings import rope_utils

    calls = []
    original = rope_utils._apply_rotary_pos_emb_thd
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    options = ModelBuildOptions(params_dtype="float32", packed_sequences=True)
    _outputs_and_grads(options, TinyArch(), groups, [_batch(0)])
    assert calls == []
    packed = pack_rows(MASK, MASK, packed_length([MASK]))
    # positions restart at each sequence: the rows' lengths are 5, 9, 4 and 3
    assert packed.params.positions[:9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]


@pytest.mark.parametrize("lengths", [[5, 3, 7, 1, 6], [2, 2, 2, 2, 40]], ids=["batched", "per-sequence"])
def test_packed_attention_equals_each_sequence_attended_alone(lengths) -> None:
    """Many similar lengths take the one right-padded SDPA call, a long tail the per-sequence
    calls; both must equal SDPA run on each sequence by itself, forward and backward."""
    import torch.nn.functional as F

    from megatron_rlhf.models import attention

    heads, groups_, dim, total = 4, 2, 8, sum(lengths)
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(total, heads, dim, generator=generator, requires_grad=True)
    key, value = (torch.randn(total, groups_, dim, generator=generator, requires_grad=True)
                  for _ in range(2))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    n, longest = len(lengths), max(lengths)
    batched = n * longest ** 2 <= attention.PADDED_WORK_LIMIT * sum(x * x for x in lengths)
    assert batched == (longest < 10), "the two cases must take the two paths"
    weights = torch.randn(total, heads * dim, generator=generator)
    got = attention.packed_causal_attention(query, key, value, cu_seqlens, longest, None)
    got_grads = torch.autograd.grad((got * weights).sum(), (query, key, value))
    expected = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        q, k, v = (x[a:b].transpose(0, 1)[None] for x in (query, key, value))
        k, v = (x.repeat_interleave(heads // groups_, dim=1) for x in (k, v))
        expected.append(F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
                        .transpose(0, 1).reshape(b - a, -1))
    expected = torch.cat(expected)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


class _HostSyncs(TorchFunctionMode):
    """Counts the host syncs that code in ``files`` would make if ``device`` tensors were on a
    GPU. A tensor is on the device when it is one of ``device`` or computed from one other than
    by ``.cpu()``; a sync reads one back to the host (``cpu``, ``item``, ``tolist``, ``bool``,
    ``int``...) or sizes an output by its values (``nonzero``, boolean indexing,
    ``repeat_interleave`` without ``output_size``)."""

    _READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
              "nonzero", "masked_select", "unique", "count_nonzero_"}

    def __init__(self, device: list[torch.Tensor], files: tuple[str, ...]) -> None:
        super().__init__()
        self._held = list(device)  # alive, so that their ids stay theirs
        self.on_device = {id(x) for x in device}
        self.files = files
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        from_device = any(id(x) in self.on_device for x in inputs)
        to_host = name == "cpu" or (name == "to" and "cpu" in map(str, (*args[1:],
                                                                         *kwargs.values())))
        if from_device and self._caller_counts() and (
                name in self._READS or to_host
                or (name == "__getitem__" and any(x.dtype == torch.bool for x in inputs[1:]))
                or (name == "repeat_interleave" and "output_size" not in kwargs)):
            self.syncs.append(name)
        result = func(*args, **kwargs)
        if to_host and result is args[0]:  # on the CPU: a copy stands for the host's
            result = result.clone()
        if from_device and not to_host:
            for x in pytree.tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    self._held.append(x)
                    self.on_device.add(id(x))
        return result

    def _caller_counts(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.endswith(self.files)


def test_the_counter_sees_the_syncs_of_a_layout_computed_on_the_device() -> None:
    mask = MASK.clone()
    with _HostSyncs([mask], ("test_packing.py",)) as counter:
        lengths = mask.sum(dim=1)
        int(lengths.sum())
        mask.bool().flatten().nonzero()
        lengths[lengths > 0]
        torch.repeat_interleave(lengths, lengths)
        host = mask.cpu()
        int(host.sum())  # on the host: free
    assert counter.syncs == ["__int__", "nonzero", "__getitem__", "repeat_interleave", "cpu"]


def _reference_layout(mask: torch.Tensor, length: int) -> tuple[list[int], list[int], list[int]]:
    """(token index, positions, cu_seqlens) of packing ``mask``'s rows, row by row."""
    index, positions, cu_seqlens = [], [], [0]
    for row, values in enumerate(mask.tolist()):
        columns = [column for column, value in enumerate(values) if value]
        index += [row * mask.shape[1] + column for column in columns]
        positions += list(range(len(columns)))
        if columns:
            cu_seqlens.append(cu_seqlens[-1] + len(columns))
    tail = length - len(index)
    if tail:
        cu_seqlens.append(length)
    return index, positions + list(range(tail)), cu_seqlens


def test_a_packed_call_reads_its_masks_back_once_and_packs_as_before(groups) -> None:
    """The layout (lengths, boundaries, cu_seqlens) comes from host copies of the masks, taken
    in one transfer for the whole call: on the device every data-dependent shape of it was a
    sync of its own (7 per micro-batch)."""
    from megatron_rlhf.models import forward_backward

    microbatches = [_batch(0), _batch(1), {k: v[1:] for k, v in _batch(2).items()}]
    packs = []
    original = forward_backward.pack_rows
    forward_backward.pack_rows = lambda *args: packs.append(original(*args)) or packs[-1]
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype="float32",
                                                          packed_sequences=True), groups)
    device = [tensor for batch in microbatches for tensor in batch.values()]
    try:
        with _HostSyncs(device, ("packing.py", "forward_backward.py")) as counter:
            run_microbatches(model, groups, microbatches, lambda output, batch: (
                output.float().sum(), {}), forward_only=True)
    finally:
        forward_backward.pack_rows = original
    assert len(counter.syncs) <= 1 < len(microbatches), counter.syncs
    assert counter.syncs == ["cpu"]
    length = packed_length([batch["attention_mask"] for batch in microbatches])
    assert length == 21
    for batch, packed in zip(microbatches, packs, strict=True):
        index, positions, cu_seqlens = _reference_layout(batch["attention_mask"], length)
        assert packed.index.tolist() == index and packed.index.dtype == torch.int64
        assert packed.position_ids[0].tolist() == positions
        assert packed.params.positions.tolist() == positions
        assert packed.params.cu_seqlens_q.tolist() == cu_seqlens
        assert packed.params.cu_seqlens_q.dtype == torch.int32
        assert packed.params.max_seqlen_q == max(b - a for a, b in pairwise(cu_seqlens))
        expected_ids = batch["input_ids"].flatten()[index].tolist() + [0] * (length - len(index))
        assert packed.input_ids[0].tolist() == expected_ids
