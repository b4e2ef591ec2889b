"""Every formula of the planner: parameters, FLOPs, memory, communication and stage times.

Pure arithmetic on architecture numbers, a device profile and link bandwidths; ``planner.predict``
applies it to a placement plan. Units inside this module: bytes, seconds, FLOPs, bytes/s.

Assumptions shared by all formulas (each function adds its own):

- Weights, activations and the KV cache are bf16 (2 bytes); gradients live in the trainer's fp32
  DDP buffers (``grad_reduce_in_fp32``, 4 bytes); the optimizer keeps fp32 master weights and
  Adam's two moments (12 bytes per parameter); logits are fp32.
- A dense transformer: per token and layer, the matrix multiplies cost 2 FLOPs per parameter
  forward (4 backward); attention scores and weighting cost ``4 * hidden * context`` FLOPs.
  The input embedding is a lookup (no FLOPs). Norms, softmax and element-wise ops are not counted.
- Compute runs at ``profile.flops_per_s`` (peak x MFU), decoding reads memory at
  ``profile.hbm_bytes_per_s``, every layer call costs ``profile.layer_latency_s`` on top, and
  every model call ``profile.call_latency_s`` (per forward-equivalent; a decode step once).
- Collectives follow the alpha-beta model with NCCL's bus bandwidth: a ring all-reduce moves
  ``2 (n-1)/n`` of the message through the slowest link of the group, a reduce-scatter or
  all-gather ``(n-1)/n``; latency grows with ``log2 n`` (tree algorithms for small messages).
- Communication is not overlapped with compute (an upper bound on time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from megatron_rlhf.planner.hardware import HardwareProfile
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


# --------------------------------------------------------------------------- sizes and FLOPs
def matmul_params(arch: ArchSpec, value_head: bool = False) -> int:
    """Parameters that take part in matrix multiplies: all but the input embedding (a lookup).

    Uses Megatron's vocabulary padding at ``tp=1``; the output layer is the vocabulary projection,
    or ``hidden`` weights for a scalar value head (critic, reward).
    """
    return arch.num_params(1, value_head) - arch.padded_vocab_size(1) * arch.hidden_size


def forward_flops(arch: ArchSpec, tokens: float, mean_context: float,
                  value_head: bool = False) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens that each attend ``mean_context`` tokens.

    ``tokens * (2 * matmul_params + 4 * layers * hidden * mean_context)``; for whole causal
    sequences of length ``s`` the mean context is ``s / 2``. Backward costs twice the forward.
    """
    attention = 4 * arch.num_layers * arch.hidden_size * mean_context
    return tokens * (2 * matmul_params(arch, value_head) + attention)


def kv_dim(arch: ArchSpec) -> int:
    """Width of the keys (or values) of one layer: ``num_query_groups * head_dim``."""
    return arch.num_query_groups * (arch.hidden_size // arch.num_attention_heads)


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


def state_bytes(params: float, tp: int, pp: int, dp: int, trainable: bool,
                sharding: str = DISTRIBUTED_OPTIMIZER) -> StateBytes:
    """Weights, gradients and optimizer state on one device, as the engine allocates them.

    With ``psi = params / (tp * pp)`` on a device and ``d = dp``:

    - inference-only models (ref, reward, shadows): bf16 weights ``2 psi``, nothing else;
    - ``replicated`` (DDP): weights ``2 psi``, fp32 gradient buffer ``4 psi``, fp32 master
      weights and Adam moments ``12 psi``: ``18 psi``;
    - ``distributed_optimizer`` (ZeRO-1): ``2 psi + 4 psi + 12 psi / d``; the gradient buffer
      stays whole (megatron reduce-scatters it in place);
    - ``fsdp`` (ZeRO-3): ``(2 + 4 + 12) psi / d``; the layers being computed are gathered on top
      (``fsdp_gathered_bytes``).
    """
    psi = params / (tp * pp)
    if not trainable:
        return StateBytes(BF16 * psi)
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: use one of {SHARDINGS}")
    optimizer = ADAM_STATE_BYTES * psi / (1 if sharding == REPLICATED else dp)
    model = psi / (dp if sharding == FULLY_SHARDED else 1)
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
    (``h + 2 kv_dim``), the attention output (``h``), and the MLP's ``3 ffn`` (gate, up, SwiGLU
    output; ``2 ffn`` for a GeLU MLP). Total ``2 s b (4 h + (2 h + 2 kv_dim + k ffn) / tp)``.
    """
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    mlp = (3 if arch.gated_mlp else 2) * ffn
    per_token = 4 * h + (2 * h + 2 * kv_dim(arch) + mlp) / tp
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
                      link: Link) -> float:
    """Gradient reduction of one optimizer step over the DP group.

    The gradients are reduced in fp32 (``4 psi`` bytes, ``psi = params / (tp pp)``). DDP
    all-reduces them; the distributed optimizer (ZeRO-1) reduce-scatters them and all-gathers the
    updated bf16 weights (``2 psi``); FSDP reduce-scatters them here and pays its weight
    all-gathers per pass (``fsdp_gather_seconds``). Not overlapped with the backward pass.
    """
    psi = params / (tp * pp)
    grads = GRAD_BYTES * psi
    if sharding == REPLICATED:
        return allreduce_seconds(grads, dp, link)
    sync = reduce_scatter_seconds(grads, dp, link)
    if sharding == DISTRIBUTED_OPTIMIZER:
        sync += all_gather_seconds(BF16 * psi, dp, link)
    return sync


def fsdp_gather_seconds(params: float, tp: int, pp: int, dp: int, link: Link) -> float:
    """FSDP gathers a device's bf16 weights from its DP group once per pass over them:
    one all-gather of ``2 params / (tp pp)`` bytes."""
    return all_gather_seconds(BF16 * params / (tp * pp), dp, link)


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

    @property
    def params(self) -> int:
        """Parameters, with Megatron's vocabulary padding for this TP."""
        return self.arch.num_params(self.tp, self.value_head)

    def slot_cost(self, tokens: float, context: float, passes: int, tp_collectives: int) -> Cost:
        """One micro-batch of ``tokens`` on one pipeline stage.

        ``passes`` forward-equivalents of compute, per-layer and per-call latency (1
        forward-only, 3 for forward+backward, 4 with recomputation); ``tp_collectives``
        all-reduces of the activations per layer (2 forward, 2 backward, 2 recomputation); one
        activation send to the next stage per forward or backward pass when ``pp > 1``.
        """
        layers = self.arch.num_layers / self.pp
        flops = passes * forward_flops(self.arch, tokens, context, self.value_head)
        compute = flops / (self.tp * self.pp * self.profile.flops_per_s)
        activation = BF16 * tokens * self.arch.hidden_size
        comm = tp_collectives * layers * allreduce_seconds(activation, self.tp, self.tp_link)
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
    slot = env.slot_cost(micro_batch * seq, seq / 2, passes=1, tp_collectives=2)
    return slot.scaled(microbatches + env.pp - 1) + env.gathers(microbatches)


def training_cost(env: ModelEnv, rows: int, seq: int, micro_batch: int, minibatches: int,
                  checkpointing: bool, epochs: int = 1) -> Cost:
    """Training on ``rows`` sequences per replica: ``epochs`` passes over them, each split into
    ``minibatches`` optimizer steps.

    Per optimizer step: ``m + pp - 1`` slots of forward+backward (``6 N`` FLOPs per token, 8 N
    with recomputation), the DP gradient reduction (``grad_sync_seconds``) and
    ``STEP_ALLREDUCES`` small all-reduces over DP, the Adam update
    (``ADAM_UPDATE_BYTES`` per local parameter at HBM speed, sharded over DP unless
    ``env.sharding`` is ``replicated``) and the fixed ``profile.step_latency_s`` of the step's
    calls. Under FSDP every micro-batch gathers the weights for its forward and again for its
    backward, and reduce-scatters its fp32 gradients (``2 m`` gathers, ``m`` reductions).
    """
    rows_per_step = math.ceil(rows / minibatches)
    micro_batch = min(micro_batch, rows_per_step)
    microbatches = math.ceil(rows_per_step / micro_batch)
    passes, collectives = (4, 6) if checkpointing else (3, 4)
    slot = env.slot_cost(micro_batch * seq, seq / 2, passes, collectives)
    pipeline = slot.scaled(microbatches + env.pp - 1)
    reductions = microbatches if env.sharding == FULLY_SHARDED else 1
    sync = reductions * grad_sync_seconds(env.params, env.tp, env.pp, env.dp, env.sharding,
                                          env.dp_link)
    sync += STEP_ALLREDUCES * allreduce_seconds(FP32, env.dp, env.dp_link)
    local = env.params / (env.tp * env.pp) / (1 if env.sharding == REPLICATED else env.dp)
    update = ADAM_UPDATE_BYTES * local / env.profile.hbm_bytes_per_s
    fixed = Cost(comm=sync, memory=update, overhead=env.profile.step_latency_s)
    fixed += env.gathers(2 * microbatches)
    return (pipeline + fixed).scaled(minibatches * epochs)


def decode_step_cost(env: ModelEnv, sequences: int, context: float) -> Cost:
    """One decode step: every sequence of a replica produces one token.

    Each pipeline stage in turn (no pipelining inside one generation batch) reads its weights
    (``2 params / (tp pp)`` bytes per device) and the KV cache at ``context`` tokens, and does
    ``2 params / (tp pp)`` FLOPs per sequence plus attention. The stage time is the roofline
    ``max(bytes / HBM bandwidth, FLOPs / compute)``; a layer does 2 TP all-reduces of
    ``sequences x hidden`` activations and costs ``layer_latency_s``; the step (one model call
    and the sampling) costs ``call_latency_s``.
    """
    arch, tp, pp = env.arch, env.tp, env.pp
    weights = BF16 * env.params / (tp * pp)
    kv = kv_cache_bytes(arch, tp, pp, sequences, context)
    flops = forward_flops(arch, sequences, context, env.value_head) / (tp * pp)
    memory_s = (weights + kv) / env.profile.hbm_bytes_per_s
    compute_s = flops / env.profile.flops_per_s
    bound = Cost(memory=pp * memory_s) if memory_s >= compute_s else Cost(compute=pp * compute_s)
    activation = BF16 * sequences * arch.hidden_size
    comm = 2 * arch.num_layers * allreduce_seconds(activation, tp, env.tp_link)
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
    prefill = env.slot_cost(sequences * prompt, prompt / 2, passes=1, tp_collectives=2)
    prefill = prefill.scaled(env.pp)
    decode = decode_step_cost(env, sequences, prompt + new_tokens / 2).scaled(new_tokens - 1)
    return (prefill + decode).scaled(rounds) + env.gathers(1)


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
