"""Every formula of the planner: parameters, FLOPs, memory, communication and stage times.

Pure arithmetic on architecture numbers, a device profile and link bandwidths; ``planner.predict``
applies it to a placement plan. Units inside this module: bytes, seconds, FLOPs, bytes/s.

Assumptions shared by all formulas (each function adds its own):

- Weights, activations and the KV cache are bf16 (2 bytes); gradients live in the trainer's fp32
  DDP buffers (``grad_reduce_in_fp32``, 4 bytes); the optimizer keeps fp32 master weights and
  Adam's two moments (12 bytes per parameter); logits are fp32.
- FLOPs are the model FLOPs of ``topology.flops``, the count the engine's MFU metrics use too:
  2 per weight of a matrix product a token passes through forward (4 backward), attention
  scores and weighting ``4 * heads * head_dim * context`` per layer; no embedding lookup, norms,
  softmax or element-wise ops. Full recomputation adds a forward.
- Mixture of experts (``arch.experts``): a token passes through the router, its ``topk`` experts
  and the shared expert, so FLOPs count those (``topology.flops``); memory counts every expert,
  the routed ones split over the expert-parallel group (``ep`` DP ranks, megatron's expert grid
  with expert TP = TP) and their gradients reduced over the ``dp / ep`` ranks holding the same
  experts. Routing is taken as balanced: each device computes its own tokens' share of expert
  work. With ``ep > 1`` the token dispatcher's all-to-alls move the routed hidden states
  (``dispatch_seconds``).
- Compute runs at ``profile.flops_per_s`` (peak x MFU), decoding reads memory at
  ``profile.hbm_bytes_per_s``, every layer call costs ``profile.layer_latency_s`` on top, and
  every model call ``profile.call_latency_s`` (per forward-equivalent; a decode step once).
- Collectives follow the alpha-beta model with NCCL's bus bandwidth: a ring all-reduce moves
  ``2 (n-1)/n`` of the message through the slowest link of the group, a reduce-scatter or
  all-gather ``(n-1)/n``; latency grows with ``log2 n`` (tree algorithms for small messages).
- Communication is not overlapped with compute (an upper bound on time).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from megatron_rlhf.planner.hardware import HardwareProfile
from megatron_rlhf.topology.flops import FORWARD_PASSES, forward_flops, training_passes
from megatron_rlhf.topology.models import ArchSpec

BF16 = 2
"""Bytes of one weight, activation or KV-cache element."""
FP32 = 4
"""Bytes of one logit (and of one experience field: log-prob, value, reward, advantage)."""
ADAM_STATE_BYTES = 12
"""fp32 master weight + Adam's first and second moment, bytes per parameter."""
GRAD_BYTES = FP32
"""One gradient: megatron's DDP accumulates and reduces them in fp32 (``grad_reduce_in_fp32``)."""
REPLICATED, DISTRIBUTED_OPTIMIZER, FULLY_SHARDED = "replicated", "distributed_optimizer", "fsdp"
SHARDINGS = (REPLICATED, DISTRIBUTED_OPTIMIZER, FULLY_SHARDED)
"""How a trainable model's states are split over its DP group, least sharded first: DDP with
replicated optimizer state (ZeRO-0), Megatron's distributed optimizer (optimizer state sharded,
ZeRO-1), Megatron-FSDP (weights, gradients and optimizer state sharded, ZeRO-3)."""
FSDP_LAYERS_GATHERED = 2
"""Layers whose full weights and gradients an FSDP rank holds at once: the one running and the
one prefetched (the engine sets Megatron-FSDP's ``suggested_communication_unit_size`` to that,
``models.trainer.FSDP_GATHERED_LAYERS``)."""
ADAM_UPDATE_BYTES = 32
"""Memory traffic of one Adam update per parameter: read and write 12 bytes of state, read the
bf16 gradient, write the bf16 weight (12 + 12 + 2 + 2, rounded up for the fp32 gradient cast)."""
HOST_OPTIMIZER_BYTES = ADAM_STATE_BYTES + GRAD_BYTES
"""Host memory per parameter of an offloaded optimizer shard: megatron's
``HybridDeviceOptimizer`` keeps the fp32 master weights and Adam moments there, and a pinned fp32
copy of the gradients it updates them from."""
ROLLOUT_BYTES_PER_TOKEN = 16
"""Generation output per token moved to the experience models: int64 token, int64 mask."""
ROLLOUT_FIELDS = 2
"""Fields of that move (token ids, attention mask): one message each."""
STEP_ALLREDUCES = 3
"""Small all-reduces over the DP group in every optimizer step besides the gradient reduction:
the loss's token count (megatron's ``finalize_model_grads``), the gradient norm for clipping, and
the check that every rank's gradients are finite. Latency-bound."""
EXPERIENCE_BYTES_PER_TOKEN = 36
"""Experience per token moved to the trainers: int64 token and mask, and about five fields of
4 bytes (response mask, sampling, old and ref log-probs, value; scores are one per row)."""
EXPERIENCE_FIELDS = 9
"""Fields of that move: token ids, attention mask, response mask, sampling log-probs, old and
ref log-probs, values, reward-model and rule scores; one message each."""


# --------------------------------------------------------------------------- sizes
def kv_dim(arch: ArchSpec) -> int:
    """Width of the keys (or values) of one layer: ``num_query_groups * head_dim``."""
    return arch.kv_width


# --------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class StateBytes:
    """Model states on one device.

    Attributes:
        weights: bf16 parameters.
        grads: fp32 gradient buffers (trainable models).
        optimizer: fp32 master weights and Adam moments (trainable models).
    """

    weights: float
    grads: float = 0.0
    optimizer: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the three."""
        return self.weights + self.grads + self.optimizer


def device_params(params: float, tp: int, pp: int, expert_params: float = 0.0,
                  ep: int = 1) -> float:
    """Parameters on one device: the dense ones over ``tp * pp``, the ``expert_params`` of the
    routed experts over ``tp * pp * ep``."""
    return (params - expert_params + expert_params / ep) / (tp * pp)


def state_bytes(params: float, tp: int, pp: int, dp: int, trainable: bool,
                sharding: str = DISTRIBUTED_OPTIMIZER, expert_params: float = 0.0,
                ep: int = 1, adapters: float = 0.0) -> StateBytes:
    """Weights, gradients and optimizer state on one device, as the engine allocates them.

    With ``psi`` the ``device_params`` (``params / (tp * pp)`` for a dense model) and ``d = dp``:

    - inference-only models (ref, reward, shadows): bf16 weights ``2 psi``, nothing else;
    - ``replicated`` (DDP): weights ``2 psi``, fp32 gradient buffer ``4 psi``, fp32 master
      weights and Adam moments ``12 psi``: ``18 psi``;
    - ``distributed_optimizer`` (ZeRO-1): ``2 psi + 4 psi + 12 params / (tp pp d)``; the
      gradient buffer stays whole (megatron reduce-scatters it in place); the experts' state is
      split over their ``d / ep`` expert-DP ranks, so with ``ep > 1`` the sharded state of a
      device is still that of ``params / (tp pp d)`` parameters;
    - ``fsdp`` (ZeRO-3): ``(2 + 4 + 12) params / (tp pp d)``; the layers being computed are
      gathered on top (``fsdp_gathered_bytes``).

    With LoRA ``adapters`` (elements of the whole model's, ``a = adapters / (tp pp)`` per
    device) the base is frozen: its weights ``2 psi`` and the adapters' ``2 a``, and gradients
    and optimizer state for the adapters alone (``4 a``; ``12 a``, or ``12 a / d`` sharded).
    An inference-only copy (a shadow) holds ``2 (psi + a)``.
    """
    psi = device_params(params, tp, pp, expert_params, ep)
    a = adapters / (tp * pp)
    if not trainable:
        return StateBytes(BF16 * (psi + a))
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: use one of {SHARDINGS}")
    if adapters:
        optimizer = ADAM_STATE_BYTES * (a if sharding == REPLICATED else a / dp)
        return StateBytes(BF16 * (psi + a), GRAD_BYTES * a, optimizer)
    sharded = params / (tp * pp * dp)
    optimizer = ADAM_STATE_BYTES * (psi if sharding == REPLICATED else sharded)
    model = sharded if sharding == FULLY_SHARDED else psi
    return StateBytes(BF16 * model, GRAD_BYTES * model, optimizer)


def layer_params(arch: ArchSpec) -> float:
    """Parameters of one transformer layer (attention, MLP, both norms)."""
    outside = arch.padded_vocab_size(1) * arch.hidden_size + 2 * arch.hidden_size
    return (arch.num_params(1, value_head=True) - outside) / arch.num_layers


def fsdp_gathered_bytes(arch: ArchSpec, tp: int, training: bool) -> float:
    """Unsharded weights an FSDP rank holds while it computes, with ``P_l`` = ``layer_params``
    and ``P_o`` the parameters outside the layers (embedding, output layer, final norm), which
    Megatron-FSDP gathers as one unit for the whole pass: ``FSDP_LAYERS_GATHERED`` layers' and
    the outside's bf16 weights (``2 (2 P_l + P_o) / tp``), and in training their fp32 gradients
    too (``4 (2 P_l + P_o) / tp``) before the reduce-scatter."""
    outside = arch.num_params(1, value_head=False) - arch.num_layers * layer_params(arch)
    per_param = BF16 + (GRAD_BYTES if training else 0)
    return per_param * (FSDP_LAYERS_GATHERED * layer_params(arch) + outside) / tp


def layer_activation_bytes(arch: ArchSpec, seq: int, micro_batch: int, tp: int) -> float:
    """Activations one layer keeps for its backward pass, one device (no sequence parallelism).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation") adapted to LLaMA-style layers
    (RMSNorm, no dropout, flash attention, so no ``seq^2`` score matrix is stored), bf16 elements:
    replicated over TP: both norm inputs and both norm outputs (``4 h``); split by TP: q, k, v
    (``q + 2 kv_dim``, ``q = heads * head_dim``), the attention output (``q``), and the MLP's
    ``3 ffn`` (gate, up, SwiGLU output; ``2 ffn`` for a GeLU MLP). Total
    ``2 s b (4 h + (2 q + 2 kv_dim + k ffn) / tp)``. A mixture-of-experts MLP keeps, per token,
    ``k ffn_e`` for each of its ``topk`` experts and ``k ffn_s`` for the shared expert (split by
    TP), and the token's ``topk`` routed copies going into and out of the experts (``2 topk h``,
    the dispatcher's buffers).
    """
    h, k = arch.hidden_size, 3 if arch.gated_mlp else 2
    experts = arch.experts
    if experts is None:
        mlp, routed = k * arch.ffn_hidden_size, 0
    else:
        mlp = k * (experts.topk * experts.ffn_hidden_size + experts.shared_ffn_size)
        routed = 2 * experts.topk * h
    per_token = 4 * h + routed + (2 * arch.query_width + 2 * kv_dim(arch) + mlp) / tp
    return BF16 * seq * micro_batch * per_token


def logits_bytes(arch: ArchSpec, tokens: float, tp: int, training: bool) -> float:
    """fp32 logits over the TP-split vocabulary; training also keeps their gradient (x2)."""
    return (2 if training else 1) * FP32 * tokens * arch.padded_vocab_size(tp) / tp


def training_activation_bytes(arch: ArchSpec, seq: int, micro_batch: int, tp: int, pp: int,
                              microbatches: int, checkpointing: bool, value_head: bool) -> float:
    """Peak activation memory of one training device (first pipeline stage, 1F1B schedule).

    Under 1F1B the first stage holds ``min(microbatches, pp)`` micro-batches in flight, each for
    its ``layers / pp`` layers. With full activation checkpointing a layer keeps only its input
    (``2 s b h``) and one layer at a time is recomputed. The logits (and their gradient) of one
    micro-batch are added unless the output is a value head.
    """
    layers = arch.num_layers // pp
    in_flight = min(microbatches, pp)
    layer = layer_activation_bytes(arch, seq, micro_batch, tp)
    if checkpointing:
        stored = in_flight * layers * BF16 * seq * micro_batch * arch.hidden_size + layer
    else:
        stored = in_flight * layers * layer
    logits = 0.0 if value_head else logits_bytes(arch, seq * micro_batch, tp, training=True)
    return stored + logits


def forward_activation_bytes(arch: ArchSpec, seq: int, micro_batch: int, tp: int,
                             value_head: bool) -> float:
    """Working memory of a forward-only pass: one layer's activations plus the fp32 logits."""
    logits = 0.0 if value_head else logits_bytes(arch, seq * micro_batch, tp, training=False)
    return layer_activation_bytes(arch, seq, micro_batch, tp) + logits


def kv_cache_bytes(arch: ArchSpec, tp: int, pp: int, sequences: float, context: float) -> float:
    """KV cache on one device: keys and values of ``layers / pp`` layers, ``kv_dim / tp`` wide.

    ``2 * (layers / pp) * (kv_dim / tp) * context * sequences * 2`` bytes.
    """
    return 2 * (arch.num_layers / pp) * (kv_dim(arch) / tp) * context * sequences * BF16


# --------------------------------------------------------------------------- communication
@dataclass(frozen=True)
class Link:
    """The bandwidth one participant of a collective gets, and the per-call latency.

    Attributes:
        bytes_per_s: bus bandwidth per participant, bytes/s.
        latency_s: fixed cost of one call.
    """

    bytes_per_s: float
    latency_s: float


def group_link(intra_node_gbps: float, inter_node_gbps: float, spans_nodes: bool,
               groups_sharing_node: int, profile: HardwareProfile) -> Link:
    """Bandwidth of a communication group.

    A group inside one node uses the device's NVLink bandwidth. A group that spans nodes is
    limited by the node's network, shared by the groups of the same model that communicate at
    the same time from that node (e.g. with ``tp=8``, the 8 DP groups of a node share its NICs).
    Gbit/s figures are turned into bytes/s and scaled by ``profile.link_efficiency``.
    """
    intra = intra_node_gbps * 1e9 / 8
    bandwidth = min(intra, inter_node_gbps * 1e9 / 8 / groups_sharing_node) if spans_nodes \
        else intra
    return Link(bandwidth * profile.link_efficiency, profile.collective_latency_s)


def _latency(n: int, link: Link) -> float:
    return link.latency_s * max(1.0, math.log2(n))


def allreduce_seconds(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` participants: ``2 (n-1)/n * nbytes / bw``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bytes_per_s + _latency(n, link)


def reduce_scatter_seconds(nbytes: float, n: int, link: Link) -> float:
    """Reduce-scatter (or all-gather) of an ``nbytes`` buffer: ``(n-1)/n * nbytes / bw``."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bytes_per_s + _latency(n, link)


all_gather_seconds = reduce_scatter_seconds
"""An all-gather moves the same volume as a reduce-scatter."""


def p2p_seconds(nbytes: float, link: Link) -> float:
    """One point-to-point transfer: ``latency + nbytes / bw``."""
    return link.latency_s + nbytes / link.bytes_per_s


def grad_sync_seconds(params: float, tp: int, pp: int, dp: int, sharding: str,
                      link: Link, expert_params: float = 0.0, ep: int = 1) -> float:
    """Gradient reduction of one optimizer step over the DP group.

    The gradients are reduced in fp32 (``4 psi`` bytes, ``psi = params / (tp pp)``). DDP
    all-reduces them; the distributed optimizer (ZeRO-1) reduce-scatters them and all-gathers the
    updated bf16 weights (``2 psi``); FSDP reduce-scatters them here and pays its weight
    all-gathers per pass (``fsdp_gather_seconds``). With ``ep > 1`` a device's experts
    (``expert_params / (tp pp ep)``) are reduced the same way over their ``dp / ep`` expert-DP
    ranks, after the dense parameters over ``dp`` (both through ``link``). Not overlapped with
    the backward pass.
    """
    def reduce(psi: float, n: int) -> float:
        if sharding == REPLICATED:
            return allreduce_seconds(GRAD_BYTES * psi, n, link)
        sync = reduce_scatter_seconds(GRAD_BYTES * psi, n, link)
        if sharding == DISTRIBUTED_OPTIMIZER:
            sync += all_gather_seconds(BF16 * psi, n, link)
        return sync

    if ep == 1:
        return reduce(params / (tp * pp), dp)
    dense = (params - expert_params) / (tp * pp)
    return reduce(dense, dp) + reduce(expert_params / (tp * pp * ep), dp // ep)


def fsdp_gather_seconds(params: float, tp: int, pp: int, dp: int, link: Link) -> float:
    """FSDP gathers a device's bf16 weights from its DP group once per pass over them:
    one all-gather of ``2 params / (tp pp)`` bytes."""
    return all_gather_seconds(BF16 * params / (tp * pp), dp, link)


def dispatch_seconds(arch: ArchSpec, tokens: float, ep: int, link: Link) -> float:
    """One all-to-all of the MoE token dispatcher over the expert-parallel group.

    Each device sends the ``topk`` routed copies of its ``tokens`` hidden states
    (``2 * tokens * topk * hidden`` bytes), ``(ep - 1) / ep`` of them to the other ``ep - 1``
    devices; the all-to-all pays ``log2 ep`` latencies like the other collectives. A layer
    forward does two (dispatch and combine), its backward two more. 0 for a dense model or
    ``ep = 1``.
    """
    if arch.experts is None or ep <= 1:
        return 0.0
    nbytes = BF16 * tokens * arch.experts.topk * arch.hidden_size
    return (ep - 1) / ep * nbytes / link.bytes_per_s + _latency(ep, link)


def experts_touched(arch: ArchSpec, tokens: float) -> float:
    """Expected share of a layer's routed experts that ``tokens`` tokens use, routing taken as
    uniform: ``1 - (1 - topk / num_experts) ** tokens`` (1 for a dense model). A decode step
    reads only those experts' weights."""
    if arch.experts is None:
        return 1.0
    return 1.0 - (1.0 - arch.experts.topk / arch.experts.num_experts) ** tokens


def pipeline_bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a 1F1B (or GPipe) pipeline: ``(pp - 1) / (m + pp - 1)``."""
    return (pp - 1) / (microbatches + pp - 1)


# --------------------------------------------------------------------------- stage costs
@dataclass(frozen=True)
class Cost:
    """Seconds of one piece of work, split by what limits it.

    Attributes:
        compute: FLOP-bound time.
        memory: device-memory-bandwidth-bound time (decoding).
        comm: collectives and transfers.
        overhead: fixed per-layer latencies.
        offload: moving model states between device and host.
    """

    compute: float = 0.0
    memory: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0
    offload: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the parts."""
        return sum(getattr(self, field.name) for field in fields(self))

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> Cost:
        """Every part times ``factor``."""
        return Cost(*(getattr(self, field.name) * factor for field in fields(self)))


@dataclass(frozen=True)
class ModelEnv:
    """One placed model on one pool, as the stage formulas see it.

    Attributes:
        arch: architecture.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size (participants of the gradient reduction).
        value_head: the output is a scalar head (critic, reward).
        profile: the device.
        tp_link: bandwidth of a TP group (inside a node).
        pp_link: bandwidth between consecutive pipeline stages.
        dp_link: bandwidth of a DP group.
        sharding: how the states are split over DP (one of ``SHARDINGS``); with ``fsdp`` every
            pass first gathers the weights.
        ep: expert-parallel size (1 for a dense model).
        ep_link: bandwidth of an expert-parallel group (needed when ``ep > 1``).
        adapters: elements of the model's LoRA adapters (all parts together); training then
            computes no weight gradient of the frozen base and reduces, updates and syncs the
            adapters alone. 0: every weight trains.
        optimizer_offload: the optimizer shard lives on the host, which runs its Adam update
            (``optimizer_offload_seconds``).
    """

    arch: ArchSpec
    tp: int
    pp: int
    dp: int
    value_head: bool
    profile: HardwareProfile
    tp_link: Link
    pp_link: Link
    dp_link: Link
    sharding: str = DISTRIBUTED_OPTIMIZER
    ep: int = 1
    ep_link: Link | None = None
    adapters: float = 0.0
    optimizer_offload: bool = False

    def __post_init__(self) -> None:
        if self.ep > 1 and self.ep_link is None:
            raise ValueError(f"ModelEnv: ep={self.ep} needs the ep_link of its expert group")

    @property
    def params(self) -> int:
        """Parameters, with Megatron's vocabulary padding for this TP (every expert)."""
        return self.arch.num_params(self.tp, self.value_head)

    @property
    def device_params(self) -> float:
        """Parameters on one device (``cost_model.device_params``)."""
        return device_params(self.params, self.tp, self.pp, self.arch.expert_params(), self.ep)

    def dispatches(self, tokens: float, count: float) -> float:
        """Seconds of ``count`` token-dispatcher all-to-alls of ``tokens`` tokens."""
        if self.ep_link is None:
            return 0.0
        return count * dispatch_seconds(self.arch, tokens, self.ep, self.ep_link)

    def slot_cost(self, tokens: float, context: float, passes: int, tp_collectives: int) -> Cost:
        """One micro-batch of ``tokens`` on one pipeline stage.

        ``passes`` forward-equivalents of compute, per-layer and per-call latency (1
        forward-only, 3 for forward+backward, 4 with recomputation); ``tp_collectives``
        all-reduces of the activations per layer (2 forward, 2 backward, 2 recomputation) and as
        many token-dispatcher all-to-alls of a mixture-of-experts layer with ``ep > 1``; one
        activation send to the next stage per forward or backward pass when ``pp > 1``.
        """
        layers = self.arch.num_layers / self.pp
        flops = passes * forward_flops(self.arch, tokens, context, self.value_head)
        compute = flops / (self.tp * self.pp * self.profile.flops_per_s)
        activation = BF16 * tokens * self.arch.hidden_size
        comm = tp_collectives * layers * allreduce_seconds(activation, self.tp, self.tp_link)
        comm += self.dispatches(tokens, tp_collectives * layers)
        if self.pp > 1:
            comm += min(passes, 2) * p2p_seconds(activation, self.pp_link)
        overhead = passes * (layers * self.profile.layer_latency_s + self.profile.call_latency_s)
        return Cost(compute=compute, comm=comm, overhead=overhead)

    def gathers(self, count: int) -> Cost:
        """``count`` FSDP weight all-gathers (none unless ``sharding`` is ``fsdp``)."""
        if self.sharding != FULLY_SHARDED:
            return Cost()
        return Cost(comm=count * fsdp_gather_seconds(self.params, self.tp, self.pp, self.dp,
                                                     self.dp_link))


def forward_cost(env: ModelEnv, rows: int, seq: int, micro_batch: int) -> Cost:
    """A forward-only pass (log-probs, values, rewards) over ``rows`` sequences on one replica.

    ``m = ceil(rows / micro_batch)`` micro-batches go through the pipeline in ``m + pp - 1``
    slots (the bubble of ``pipeline_bubble_fraction``); each slot is one micro-batch on one stage.
    Under FSDP each micro-batch's forward gathers the weights.
    """
    if rows == 0:
        return Cost()
    micro_batch = min(micro_batch, rows)
    microbatches = math.ceil(rows / micro_batch)
    slot = env.slot_cost(micro_batch * seq, seq / 2, FORWARD_PASSES, tp_collectives=2)
    return slot.scaled(microbatches + env.pp - 1) + env.gathers(microbatches)


def training_cost(env: ModelEnv, rows: int, seq: int, micro_batch: int, minibatches: int,
                  checkpointing: bool, epochs: int = 1) -> Cost:
    """Training on ``rows`` sequences per replica: ``epochs`` passes over them, each split into
    ``minibatches`` optimizer steps.

    Per optimizer step: ``m + pp - 1`` slots of forward+backward (``6 N`` FLOPs per token, 8 N
    with recomputation; with LoRA ``env.adapters`` ``4 N`` and ``6 N``, the frozen base's
    backward computing the activations' gradients alone, and the reduction and update below
    over the adapters' elements instead of ``N``), the DP gradient reduction
    (``grad_sync_seconds``) and
    ``STEP_ALLREDUCES`` small all-reduces over DP, the Adam update
    (``ADAM_UPDATE_BYTES`` per local parameter at HBM speed, sharded over DP unless
    ``env.sharding`` is ``replicated``; on the host with ``env.optimizer_offload``,
    ``optimizer_offload_seconds``) and the fixed ``profile.step_latency_s`` of the step's
    calls. Under FSDP every micro-batch gathers the weights for its forward and again for its
    backward, and reduce-scatters its fp32 gradients (``2 m`` gathers, ``m`` reductions).
    """
    rows_per_step = math.ceil(rows / minibatches)
    micro_batch = min(micro_batch, rows_per_step)
    microbatches = math.ceil(rows_per_step / micro_batch)
    passes = training_passes(frozen_base=bool(env.adapters), recomputed=checkpointing)
    collectives = 6 if checkpointing else 4
    slot = env.slot_cost(micro_batch * seq, seq / 2, passes, collectives)
    pipeline = slot.scaled(microbatches + env.pp - 1)
    reductions = microbatches if env.sharding == FULLY_SHARDED else 1
    if env.adapters:  # spread over the model's devices, experts' adapters included
        sync = grad_sync_seconds(env.adapters, env.tp, env.pp, env.dp, env.sharding,
                                 env.dp_link)
        trained = env.adapters / (env.tp * env.pp)
    else:
        sync = reductions * grad_sync_seconds(env.params, env.tp, env.pp, env.dp, env.sharding,
                                              env.dp_link, env.arch.expert_params(), env.ep)
        trained = env.device_params
    sync += STEP_ALLREDUCES * allreduce_seconds(FP32, env.dp, env.dp_link)
    local = trained if env.sharding == REPLICATED else (
        (env.adapters or env.params) / (env.tp * env.pp * env.dp))
    if env.optimizer_offload:
        update = Cost(offload=optimizer_offload_seconds(local, env.profile))
    else:
        update = Cost(memory=ADAM_UPDATE_BYTES * local / env.profile.hbm_bytes_per_s)
    fixed = update + Cost(comm=sync, overhead=env.profile.step_latency_s)
    fixed += env.gathers(2 * microbatches)
    return (pipeline + fixed).scaled(minibatches * epochs)


def decode_step_cost(env: ModelEnv, sequences: int, context: float) -> Cost:
    """One decode step: every sequence of a replica produces one token.

    Each pipeline stage in turn (no pipelining inside one generation batch) reads its weights
    (``2 params / (tp pp)`` bytes per device) and the KV cache at ``context`` tokens, and does
    ``2 params / (tp pp)`` FLOPs per sequence plus attention. The stage time is the roofline
    ``max(bytes / HBM bandwidth, FLOPs / compute)``; a layer does 2 TP all-reduces of
    ``sequences x hidden`` activations and costs ``layer_latency_s``; the step (one model call
    and the sampling) costs ``call_latency_s``. A mixture-of-experts model does the FLOPs of its
    active parameters, reads its dense weights and the share of its local experts that the
    ``ep * sequences`` tokens of its expert group use (``experts_touched``), and a layer adds
    2 dispatcher all-to-alls when ``ep > 1``.
    """
    arch, tp, pp = env.arch, env.tp, env.pp
    experts = arch.expert_params() / (tp * pp * env.ep)
    touched = experts_touched(arch, env.ep * sequences)
    weights = BF16 * (env.device_params - experts + touched * experts)
    kv = kv_cache_bytes(arch, tp, pp, sequences, context)
    flops = forward_flops(arch, sequences, context, env.value_head) / (tp * pp)
    memory_s = (weights + kv) / env.profile.hbm_bytes_per_s
    compute_s = flops / env.profile.flops_per_s
    bound = Cost(memory=pp * memory_s) if memory_s >= compute_s else Cost(compute=pp * compute_s)
    activation = BF16 * sequences * arch.hidden_size
    comm = 2 * arch.num_layers * allreduce_seconds(activation, tp, env.tp_link)
    comm += env.dispatches(sequences, 2 * arch.num_layers)
    comm += (pp - 1) * p2p_seconds(activation, env.pp_link)
    overhead = arch.num_layers * env.profile.layer_latency_s + env.profile.call_latency_s
    return bound + Cost(comm=comm, overhead=overhead)


def generation_cost(env: ModelEnv, rows: int, prompt: int, new_tokens: int,
                    max_sequences: int) -> Cost:
    """Generation of ``rows`` responses on one replica, at most ``max_sequences`` at a time.

    ``ceil(rows / max_sequences)`` rounds (the KV cache bounds a round); each round prefills its
    prompts (compute-bound, like a forward pass over ``prompt`` tokens per sequence, one
    micro-batch, pipeline stages in turn), which samples the first token, and then decodes the
    other ``new_tokens - 1`` in as many steps at the mean context ``prompt + new_tokens / 2``.
    Under FSDP the weights are gathered once and held for the whole generation.
    """
    if rows == 0:
        return Cost()
    rounds = math.ceil(rows / max_sequences)
    sequences = math.ceil(rows / rounds)
    prefill = env.slot_cost(sequences * prompt, prompt / 2, FORWARD_PASSES, tp_collectives=2)
    prefill = prefill.scaled(env.pp)
    decode = decode_step_cost(env, sequences, prompt + new_tokens / 2).scaled(new_tokens - 1)
    return (prefill + decode).scaled(rounds) + env.gathers(1)


@dataclass(frozen=True)
class DecodeSegment:
    """Decode steps that compute the same number of slots.

    Attributes:
        slots: sequences each decode step computes (the decode batch, empty slots included).
        steps: decode steps.
        mean_age: tokens the answers still decoding have generated, on average over their
            steps (the attended context beyond the prompt).
    """

    slots: int
    steps: int
    mean_age: float


def decode_schedule(queue: Sequence[int], slots: int, continuous: bool,
                    check_interval: int = 1) -> list[DecodeSegment]:
    """The decode steps of one replica generating answers of lengths ``queue`` (in queue
    order), ``slots`` at a time, as the engine batches them (``generation/continuous.py``).

    An answer of ``L`` tokens takes its first token from the prefill and ``L - 1`` decode steps;
    the engine sees that it ended at the next stop check (every ``check_interval`` steps, and
    after at least one step), so it holds its slot ``check_interval * ceil(max(L - 1, 1) /
    check_interval)`` steps. ``continuous``: a slot whose answer ended takes the next queued
    prompt at that check, so the batch stays full while the queue lasts (throughput ``total
    tokens / slots``); at a check where no prompt waits, the batch shrinks to the smallest power
    of two that holds the answers still decoding, and the call ends with its last answer (the
    tail). Otherwise (static batching) the queue runs in rounds of ``slots`` answers, each
    round's ``check_interval * ceil(longest / check_interval)`` forwards, its prefill first.

    Returns:
        Segments in time order, one per change of the batch size (or per static round).
    """
    return list(_decode_schedule(tuple(queue), slots, continuous, check_interval))


@functools.lru_cache(maxsize=256)
def _decode_schedule(queue: tuple[int, ...], slots: int, continuous: bool,
                     interval: int) -> tuple[DecodeSegment, ...]:
    """``decode_schedule``, kept per queue: a placement search prices one queue often."""
    if not continuous:
        rounds = [queue[i:i + slots] for i in range(0, len(queue), slots)]
        steps = [interval * math.ceil(max(r) / interval) - 1 for r in rounds]
        return tuple(DecodeSegment(len(r), n, (n + 1) / 2) for r, n in zip(rounds, steps,
                                                                           strict=True) if n)
    waiting = list(reversed(queue))
    active: list[tuple[int, int]] = []  # (check that sees it ended, start step) per answer
    spans: list[list[float]] = []  # per batch size: slots, steps, answer-steps, summed ages
    now, batch, started = 0, slots, 0
    while True:
        if not waiting and now:  # a check with no prompt waiting: keep the bucket in use
            batch = min(batch, 1 << max(len(active) - 1, 0).bit_length())
        while waiting and len(active) < slots:  # the slots that ended take waiting prompts
            held = interval * math.ceil(max(waiting.pop() - 1, 1) / interval)
            heapq.heappush(active, (now + held, now))
            started += now
        if not active:
            break
        end = active[0][0]
        if not waiting and 1 << (len(active) - 1).bit_length() < batch:
            end = min(end, now + interval)  # the next check keeps a smaller bucket
        n, steps = len(active), end - now
        # an answer started at step s has generated tau - s + 1 tokens at step tau
        ages = steps * (n - started) + n * (now + end - 1) * steps / 2
        if not spans or spans[-1][0] != batch:
            spans.append([batch, 0, 0, 0.0])
        spans[-1][1:] = [spans[-1][1] + steps, spans[-1][2] + n * steps, spans[-1][3] + ages]
        now = end
        while active and active[0][0] == now:
            started -= heapq.heappop(active)[1]
    return tuple(DecodeSegment(int(b), int(steps), ages / weight)
                 for b, steps, weight, ages in spans)


def answers_generation_cost(env: ModelEnv, queue: Sequence[int], prompt: int,
                            max_sequences: int, continuous: bool,
                            check_interval: int = 1) -> Cost:
    """Generation of the answers ``queue`` (lengths, in queue order) on one replica, at most
    ``max_sequences`` at a time (``generation_cost`` when every answer has one length).

    ``ceil(rows / max_sequences)`` rounds' worth of prefills of ``ceil(rows / rounds)`` prompts
    each, and the decode steps of ``decode_schedule`` with that many slots, each segment priced
    by ``decode_step_cost`` at its batch size and its mean context ``prompt + mean age``. With
    every answer ``G`` tokens, one round and a stop check every step this is
    ``generation_cost`` exactly.
    """
    rows = len(queue)
    if rows == 0:
        return Cost()
    rounds = math.ceil(rows / max_sequences)
    slots = math.ceil(rows / rounds)
    prefill = env.slot_cost(slots * prompt, prompt / 2, FORWARD_PASSES, tp_collectives=2)
    total = prefill.scaled(env.pp * rounds) + env.gathers(1)
    for segment in decode_schedule(queue, slots, continuous, check_interval):
        step = decode_step_cost(env, segment.slots, prompt + segment.mean_age)
        total += step.scaled(segment.steps)
    return total


def transfer_seconds(nbytes: float, fields: int, link: Link) -> float:
    """Rows of ``fields`` fields moved between two models' ranks through ``link``.

    The engine sends every field of a row range as its own message; the messages to different
    peers overlap, those of different fields are paid one after another: ``fields * latency +
    nbytes / bw``. On 4 gloo ranks sharing 2 cores the engine's 9-field gather measures about 9
    all-reduce latencies at the host's slowdown (``benchmarks/placements.py``); an exchange of
    bare tensors costs less (``benchmarks/gloo_latency.py``): the engine's work per field counts.
    """
    return fields * link.latency_s + nbytes / link.bytes_per_s


def weight_sync_seconds(params: float, shadow_tp: int, shadow_pp: int, shadow_devices: int,
                        receiving_nodes: int, sending_nodes: int, link: Link) -> float:
    """Copy trained bf16 weights into a shadow with another layout (resharding).

    Every shadow device receives its shard, ``2 params / (tp_s pp_s)`` bytes, so ``dp_s`` full
    copies leave the trainer. Across nodes the busiest node NIC sets the time: a receiving node
    takes ``shadow_devices / receiving_nodes`` shards, a sending node sends
    ``dp_s * 2 params / sending_nodes``. ``link`` is the per-node network (or, when trainer and
    shadow share nodes, one device's NVLink with ``receiving_nodes = shadow_devices``). The refit
    posts the sends and receives of every parameter tensor at once, so the link latency is paid
    once, not once per tensor (``benchmarks/placements.py`` on CPU: a sync of the tiny models'
    ~30 tensors takes about 3 all-reduce latencies).
    """
    shard = BF16 * params / (shadow_tp * shadow_pp)
    received = shard * shadow_devices / receiving_nodes
    sent = shard * shadow_devices / sending_nodes
    return link.latency_s + max(received, sent) / link.bytes_per_s


def offload_seconds(nbytes: float, profile: HardwareProfile) -> float:
    """One use of an offloaded model: ``nbytes`` copied to the device before the stage and back
    to the host after it, over PCIe (the engine's ``StateOffloader`` copies both ways each time).
    """
    return 2 * nbytes / profile.host_bytes_per_s


def optimizer_offload_seconds(params: float, profile: HardwareProfile) -> float:
    """One optimizer step of a device's ``params``-parameter shard with the optimizer on the
    host (megatron's ``HybridDeviceOptimizer``): the fp32 gradients copied to the host and the
    updated bf16 weights back over PCIe (``profile.host_bytes_per_s``), and Adam on the host's
    cores (``profile.host_adam_params_per_s``), one after the other."""
    copies = (GRAD_BYTES + BF16) * params / profile.host_bytes_per_s
    return copies + params / profile.host_adam_params_per_s
