"""benchmarks/train_breakdown.py: its op classifier, GEMM FLOP and loss attribution."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_breakdown as tb  # noqa: E402

BACKWARD = tb.BACKWARD_PREFIX


def _event(name: str, parent=None, sequence_nr: int = -1) -> SimpleNamespace:
    return SimpleNamespace(name=name, cpu_parent=parent, sequence_nr=sequence_nr)


def test_classify_names_the_categories_of_the_ops_a_training_step_runs() -> None:
    cases = {
        "aten::mm": "gemm", "aten::linear": "gemm", "LinearWithGradAccumulationAndAsync"
        "CommunicationBackward": "gemm", f"{BACKWARD}MmBackward0": "gemm",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        f"{BACKWARD}ScaledDotProductFlashAttentionForCpuBackward0": "attention",
        "aten::mul": "elementwise", f"{BACKWARD}SiluBackward0": "elementwise",
        f"{BACKWARD}torch::autograd::AccumulateGrad": "optimizer",
        "Optimizer.step#AdamW.step": "optimizer", tb.OPTIMIZER_SCOPE: "optimizer",
        tb.LOSS_SCOPE: "loss", tb.STEP_SCOPE: None, "_ReduceFromModelParallelRegion": None,
    }
    assert {name: tb.classify(name) for name in cases} == cases


def test_the_outermost_op_claims_the_ops_it_calls_and_scopes_win() -> None:
    step = tb.STEP_SCOPE
    matmul = _event("aten::matmul", _event(step))
    assert tb.event_category(_event("aten::copy_", matmul), set()) == "gemm"
    assert tb.event_category(_event(step), set()) == "host"
    optimizer = _event(tb.OPTIMIZER_SCOPE, _event(step))
    assert tb.event_category(_event("aten::mm", optimizer), set()) == "optimizer"
    node = _event(f"{BACKWARD}MulBackward0", _event(step), sequence_nr=7)
    assert tb.event_category(_event("aten::mul", node), {7}) == "loss"
    assert tb.event_category(_event("aten::mul", node), {8}) == "elementwise"


def test_loss_sequence_numbers_leave_out_numbers_shared_with_other_forward_ops() -> None:
    step = _event(tb.STEP_SCOPE)
    loss = _event(tb.LOSS_SCOPE, step)
    backward = _event(f"{BACKWARD}EmbeddingBackward0", step, sequence_nr=5)
    events = [_event("aten::exp", loss, 4), _event("aten::mul", loss, 5),
              _event("aten::embedding", step, 5), backward,
              _event("aten::embedding_dense_backward", backward, 4)]
    assert tb.loss_sequence_numbers(events) == {4}


def test_gemm_flop_and_shape_from_recorded_shapes() -> None:
    assert tb.gemm_flop("aten::mm", [[1024, 256], [256, 1376]]) == 2 * 1024 * 256 * 1376
    assert tb.gemm_flop("aten::addmm", [[8], [4, 3], [3, 8]]) == 2 * 4 * 3 * 8
    assert tb.gemm_flop("aten::bmm", [[5, 4, 3], [5, 3, 2]]) == 2 * 5 * 4 * 3 * 2
    assert tb.gemm_flop("aten::matmul", [[4, 3], [3, 8]]) == 0  # counted in the mm it calls
    assert tb.gemm_shape("aten::addmm", [[8], [4, 3], [3, 8]]) == "4 x 3 x 8"
    assert tb.gemm_shape("aten::bmm", [[5, 4, 3], [5, 3, 2]]) == "5 x 4 x 3 x 2"
    assert tb.shape_dims("5 x 4 x 3 x 2") == (20, 3, 2)
    assert tb.shape_dims("1024 x 256 x 1376") == (1024, 256, 1376)
