"""Mixture-of-experts layers through megatron-core's MoE layer, and its routing replay.

    moe = MoEConfig(num_experts=4, topk=2)                  # models.moe.*, as users set it
    arch = replace(arch, experts=moe.expert_spec(arch.ffn_hidden_size))  # the experts: architecture
    model = build_gpt_model(arch, ModelBuildOptions(moe=moe.routing()), pg_collection)
    with recording_routes(model) as routes:                 # the rollout's forward
        model(...)
    with replaying_routes(model, routes):                   # a training forward: same experts
        model(...)

The experts (how many, their width, top-k) are the architecture's, ``ArchSpec.experts``, the one
record of them; :class:`MoERouting` holds the rest that megatron's MoE layer needs, how tokens are
routed and the router trained. :class:`MoEConfig`, the user's ``models.moe`` section, gives
both. Experts are megatron's ``SequentialMLP`` (one SwiGLU MLP per local expert, no grouped GEMM, so
the CPU runs them), the router its ``TopKRouter`` with a load-balancing loss, the token
dispatcher its all-to-all or all-gather one over the model's expert-parallel group
(``pg_collection.ep``; ``topology.experts`` builds it). Expert parameters are named by their
global expert index in full states (``models.weights``), so a checkpoint does not depend on EP.

Routing replay uses megatron's ``RouterReplay`` (``moe_enable_routing_replay``), driven per model
rather than through its process-wide list, since a process may hold several MoE models. Recorded
routes follow the router's input order (padded ``[s * b]`` or packed); :func:`routes_to_rows`
turns them into ``[b, s, layers, topk]`` by row and position, which :func:`rows_to_routes` lays
out again for a forward over any subset of the rows, padded or packed (TP = 1 or without
sequence parallelism: under it each TP rank routes its own sequence chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rlhf.topology.models import ExpertSpec

ROUTES = "moe_routes"
"""The batch field of a policy's recorded routes, ``[b, s, layers, topk]`` (:func:`routes_to_rows`):
written by a forward that records, read by one that replays (``models.forward_backward``)."""
LOAD_BALANCING_TYPES: tuple[str, ...] = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
TOKEN_DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather")


@dataclass(frozen=True)
class MoERouting:
    """How a mixture-of-experts model routes its tokens and trains its router: what megatron's
    MoE layer needs beside the architecture's experts (``ArchSpec.experts``), as
    ``ModelBuildOptions.moe``. The fields are :class:`MoEConfig`'s of the same names, which
    builds it (:meth:`MoEConfig.routing`).

    Attributes:
        load_balancing: the router's load-balancing loss (megatron's
            ``moe_router_load_balancing_type``), one of :data:`LOAD_BALANCING_TYPES`.
        aux_loss_coeff: weight of the load-balancing loss in the gradient.
        z_loss_coeff: weight of the router z-loss; 0: none.
        token_dispatcher: ``alltoall`` or ``allgather``.
        router_replay: build the routers able to record and replay routes
            (:func:`recording_routes`, :func:`replaying_routes`).
    """

    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    token_dispatcher: str = "alltoall"
    router_replay: bool = True

    def __post_init__(self) -> None:
        if self.load_balancing not in LOAD_BALANCING_TYPES:
            raise ValueError(f"models.moe.load_balancing={self.load_balancing!r}: use one of "
                             f"{LOAD_BALANCING_TYPES}")
        if self.token_dispatcher not in TOKEN_DISPATCHERS:
            raise ValueError(f"models.moe.token_dispatcher={self.token_dispatcher!r}: use one "
                             f"of {TOKEN_DISPATCHERS}")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError(f"models.moe.aux_loss_coeff={self.aux_loss_coeff} and "
                             f"models.moe.z_loss_coeff={self.z_loss_coeff} must be >= 0")


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (megatron's MoE layer in every transformer layer).

    Attributes:
        num_experts: routed experts per layer; 0: a dense model (the other fields are unused).
        topk: experts each token is sent to.
        renormalize_topk: the chosen experts' weights are the softmax over their own router
            logits, so they sum to 1 (Mixtral, Qwen3-MoE with ``norm_topk_prob``); false: their
            probabilities in the softmax over all experts (megatron's
            ``moe_router_pre_softmax``).
        ffn_hidden_size: width of each expert's SwiGLU MLP; 0: the architecture's
            ``ffn_hidden_size``.
        shared_expert_ffn_size: width of a shared expert every token also passes through
            (Qwen2-MoE, DeepSeek); 0: none.
        load_balancing: the router's load-balancing loss (megatron's
            ``moe_router_load_balancing_type``): ``aux_loss`` (over a micro-batch),
            ``seq_aux_loss`` (per sequence), ``global_aux_loss`` (over the data-parallel
            batch) or ``none``.
        aux_loss_coeff: weight of the load-balancing loss in the gradient.
        z_loss_coeff: weight of the router z-loss (the squared log-sum-exp of the router
            logits); 0: none.
        token_dispatcher: how tokens reach the experts of other expert-parallel ranks:
            ``alltoall`` or ``allgather``.
        router_replay: record the experts the policy chose for every token when the
            experience's old log-probs are computed, and route the tokens the same way in every
            training pass of the actor on those rows, so that the PPO ratio compares one
            routing (needs pp=1, no sequence parallelism under TP, no full recomputation; not
            with ``rollout.reuse_generation_logprobs``). false: each pass routes afresh.
    """

    num_experts: int = 0
    topk: int = 2
    renormalize_topk: bool = True
    ffn_hidden_size: int = 0
    shared_expert_ffn_size: int = 0
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    token_dispatcher: str = "alltoall"
    router_replay: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "ffn_hidden_size", "shared_expert_ffn_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"models.moe.{name}={value!r} must be an integer >= 0 (0: "
                                 f"{'dense' if name == 'num_experts' else 'the default'})")
        if self.num_experts and not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"models.moe.topk={self.topk} must be in [1, num_experts="
                             f"{self.num_experts}]")
        self.routing()  # checks the routing settings

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts > 0

    def routing(self) -> MoERouting:
        """The routing and router-training settings (``ModelBuildOptions.moe``); the experts
        go to the architecture (:meth:`expert_spec`)."""
        return MoERouting(load_balancing=self.load_balancing, aux_loss_coeff=self.aux_loss_coeff,
                          z_loss_coeff=self.z_loss_coeff,
                          token_dispatcher=self.token_dispatcher,
                          router_replay=self.router_replay)

    def expert_spec(self, ffn_hidden_size: int) -> ExpertSpec | None:
        """The architecture's experts these settings describe (None when dense), an expert's
        width defaulting to the architecture's ``ffn_hidden_size``."""
        if not self.enabled:
            return None
        return ExpertSpec(self.num_experts, self.topk, self.ffn_hidden_size or ffn_hidden_size,
                          self.shared_expert_ffn_size, self.renormalize_topk)

    def check_expert_parallel(self, eps: dict[str, int], fsdp_roles: tuple[str, ...] = (),
                              multi_turn: bool = False,
                              ep_field: str = "placement.parallel.{role}.ep",
                              moe_field: str = "models.moe") -> None:
        """Refuse expert-parallel sizes this model cannot take.

        Args:
            eps: ``placement.parallel.<role>.ep`` of each role that sets it.
            fsdp_roles: the trained roles under Megatron-FSDP (``<role>_optimizer.fsdp``).
            multi_turn: rollouts are episodes of several replies (``rollout.max_turns > 1``
                with tools or an environment), a generation call per turn while any episode of
                the rank goes on.
            ep_field, moe_field: the fields messages name (a supervised run's ``model.ep``
                and ``model.moe``); ``{role}`` in ``ep_field`` is replaced by the role.

        Raises:
            ValueError: ``ep > 1`` for a dense model, ``ep`` not dividing ``num_experts``, with
                the all-gather dispatcher, for a model trained under Megatron-FSDP, or for the
                policy of multi-turn episodes.
        """
        for role, ep in sorted(eps.items()):
            if ep == 1:
                continue
            field_ = f"{ep_field.format(role=role)}={ep}"
            if not self.enabled:
                raise ValueError(f"{field_} splits experts, but the models are dense "
                                 f"({moe_field}.num_experts=0): set {moe_field}.num_experts or "
                                 "drop the ep")
            if self.num_experts % ep:
                divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
                raise ValueError(f"{field_} does not divide {moe_field}.num_experts="
                                 f"{self.num_experts}: choose ep in {divisors}")
            if multi_turn and role in ("actor", "shadow_actor"):
                raise ValueError(f"{field_} with multi-turn episodes (rollout.max_turns > 1): "
                                 "each rank decodes a turn while its own episodes go on, so the "
                                 "expert-parallel ranks would run different numbers of forwards; "
                                 "set the policy's ep to 1 or rollout.max_turns=1")
            if self.token_dispatcher == "allgather":
                raise ValueError(f"{moe_field}.token_dispatcher=allgather with {field_}: "
                                 "megatron's all-gather dispatcher needs as many tokens on every "
                                 "expert-parallel rank, and replicas' micro-batches differ in "
                                 "length; use alltoall")
            if role in fsdp_roles:
                raise ValueError(f"{field_} with {role}_optimizer.fsdp=true: expert parallelism "
                                 f"runs under megatron's DDP here; set {role}_optimizer.fsdp=false "
                                 "or ep=1")


def moe_transformer_fields(experts: ExpertSpec | None, moe: MoERouting | None, ep_size: int,
                           tp_size: int) -> dict[str, Any]:
    """megatron ``TransformerConfig`` fields of an architecture's ``experts`` ({} for a dense
    model), trained and routed as ``moe`` says (its defaults when None).

    Raises:
        ValueError: ``ep_size`` does not divide the number of experts.
    """
    if experts is None:
        return {}
    moe = moe or MoERouting()
    if experts.num_experts % ep_size:
        raise ValueError(f"models.moe.num_experts={experts.num_experts} is not divisible by the "
                         f"model's expert-parallel size ep={ep_size}: choose ep dividing it")
    return {
        "num_moe_experts": experts.num_experts,
        "moe_router_topk": experts.topk,
        "moe_router_pre_softmax": not experts.renormalize_topk,
        "moe_ffn_hidden_size": experts.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": experts.shared_ffn_size or None,
        "moe_router_load_balancing_type": moe.load_balancing,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_token_dispatcher_type": moe.token_dispatcher,
        # routing in fp32 whatever the parameters' dtype: bf16 scores flip near-ties
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": moe.router_replay,
        "expert_model_parallel_size": ep_size,
        "expert_tensor_parallel_size": tp_size,
    }


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers (megatron's ``TopKRouter``), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def _replays(model: torch.nn.Module) -> list[Any]:
    replays = [router.router_replay for router in moe_routers(model)]
    if not replays or any(replay is None for replay in replays):
        raise ValueError("the model has no MoE routers able to replay: build it with experts "
                         "(ArchSpec.experts) and ModelBuildOptions(moe=MoERouting("
                         "router_replay=True))")
    return replays


@contextmanager
def recording_routes(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the experts every router chooses during the forwards inside the context.

    Yields a list that, on exit, holds one ``[tokens, topk]`` int64 tensor per MoE layer of this
    rank (the last forward's choices; tokens in megatron's ``[s * b]`` order of the router's
    input, which under sequence parallelism is this TP rank's sequence chunk).

    Raises:
        ValueError: the model cannot record (dense, or built without ``router_replay``).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    routes: list[torch.Tensor] = []
    for replay in replays:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield routes
        routes.extend(replay.get_recorded_indices().detach().clone() for replay in replays)
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


@contextmanager
def replaying_routes(model: torch.nn.Module, routes: list[torch.Tensor]) -> Iterator[None]:
    """Route every token to the experts in ``routes`` (from :func:`recording_routes` over the
    same tokens) in the forwards inside the context, instead of the router's own top-k; the
    router's probabilities for those experts still come from its current weights, so its
    gradient flows.

    Raises:
        ValueError: the model cannot replay, or ``routes`` has another number of layers.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _replays(model)
    if len(routes) != len(replays):
        raise ValueError(f"{len(routes)} recorded layers for a model with {len(replays)} MoE "
                         "layers on this rank: record and replay with the same model layout")
    for replay, indices in zip(replays, routes, strict=True):
        replay.clear_indices()
        replay.target_topk_idx = indices
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


def routes_to_rows(routes: list[torch.Tensor], shape: tuple[int, int],
                   packed_index: torch.Tensor | None = None) -> torch.Tensor:
    """Recorded routes of one forward -> ``[b, s, layers, topk]`` int64 by row and position
    (-1 at padding), a layout that micro-batches of other sizes or packing can replay.

    Args:
        routes: :func:`recording_routes`' tensors, one ``[tokens, topk]`` per MoE layer.
        shape: ``(b, s)`` of the padded micro-batch.
        packed_index: ``PackedRows.index`` when the forward ran packed (tokens in packed order),
            None for the padded ``[s * b]`` order.
    """
    rows, seq = shape
    stacked = torch.stack(routes, dim=1)  # [tokens, layers, topk]
    if packed_index is None:
        return stacked.view(seq, rows, *stacked.shape[1:]).transpose(0, 1).contiguous()
    out = stacked.new_full((rows * seq, *stacked.shape[1:]), -1)
    out[packed_index] = stacked[:packed_index.numel()]
    return out.view(rows, seq, *stacked.shape[1:])


def rows_to_routes(rows: torch.Tensor, packed_index: torch.Tensor | None = None,
                   packed_length: int = 0) -> list[torch.Tensor]:
    """``[b, s, layers, topk]`` routes (:func:`routes_to_rows`) -> one ``[tokens, topk]`` per
    layer in the order of a forward over those rows: padded (``packed_index`` None) or packed
    into ``packed_length`` tokens. Tokens without a route (padding, the packed tail; their
    outputs are never read) go to experts ``0 .. topk-1``.
    """
    b, s, layers, topk = rows.shape
    fallback = torch.arange(topk, device=rows.device).expand(layers, topk)
    if packed_index is None:
        tokens = rows.transpose(0, 1).reshape(s * b, layers, topk)
    else:
        tokens = fallback.expand(packed_length, layers, topk).clone()
        tokens[:packed_index.numel()] = rows.reshape(b * s, layers, topk)[packed_index]
    tokens = torch.where(tokens < 0, fallback, tokens)
    return list(tokens.unbind(dim=1))


def replays_routes(model: torch.nn.Module) -> bool:
    """Whether forwards of ``model`` (or a wrapper of it) record and replay routes by row: MoE
    layers built with ``router_replay``, one pipeline stage, no sequence parallelism (under
    which each TP rank routes only its chunk of the sequence), no full recomputation (whose
    backward reruns the router outside the replaying forward)."""
    routers = moe_routers(model)
    if not routers or any(router.router_replay is None for router in routers):
        return False
    config = routers[0].config
    return (config.pipeline_model_parallel_size == 1 and not config.sequence_parallel
            and config.recompute_granularity != "full")


@contextmanager
def routes_of_batch(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                    packed_index: torch.Tensor | None, packed_length: int) -> Iterator[None]:
    """Around one micro-batch's forward: replay ``batch[ROUTES]`` when it is there, else record
    the routes into it (by row and position); nothing for a model that does not
    :func:`replays_routes` or inside :func:`recording_routes` or :func:`replaying_routes`.

    Args:
        packed_index: ``PackedRows.index`` when the forward runs packed, else None.
        packed_length: tokens of the packed row (unused when not packed).
    """
    if not replays_routes(model):
        if ROUTES in batch:
            raise ValueError("this micro-batch brings routes to replay, but the model cannot "
                             "replay them by row (dense, pp > 1, sequence parallelism or full "
                             "recomputation): set models.moe.router_replay=false")
        yield
        return
    if any(replay.router_replay_action is not None for replay in _replays(model)):
        yield  # inside recording_routes or replaying_routes: they decide
        return
    if ROUTES in batch:
        routes = rows_to_routes(batch[ROUTES].long(), packed_index, packed_length)
        with replaying_routes(model, routes):
            yield
        return
    with recording_routes(model) as routes:
        yield
    batch[ROUTES] = routes_to_rows(routes, tuple(batch["input_ids"].shape), packed_index)


@contextmanager
def expert_metrics(model: torch.nn.Module, pg_collection: Any) -> Iterator[dict[str, float]]:
    """Router metrics of the passes of ``model`` inside the context, the same on every rank of
    the model (reduced over its DP and PP groups). Yields a dict filled on exit ({} for a dense
    model):

    * ``moe_max_load``: the most tokens one expert received over the mean per expert (1:
      balanced; ``num_experts / topk`` at most), the largest over layers;
    * ``moe_load_balancing_loss`` and ``moe_z_loss`` (with a z-loss): megatron's logged values
      without their coefficients, averaged over layers and passes.

    Counts include every token the routers see (padding of padded rows too).
    """
    from megatron.core.transformer.moe import moe_utils

    routers = moe_routers(model)
    metrics: dict[str, float] = {}
    if not routers:
        yield metrics
        return
    config = routers[0].config
    counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.float64)
    calls = torch.zeros(config.num_layers, dtype=torch.float64)

    def count(router: torch.nn.Module, _args: Any, output: Any) -> None:
        layer = router.layer_number - 1
        counts[layer] += output[1].detach().sum(dim=0).to("cpu", torch.float64)
        calls[layer] += 1

    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # other models' entries too
    hooks = [router.register_forward_hook(count) for router in routers]
    try:
        yield metrics
    finally:
        for hook in hooks:
            hook.remove()
    device = next(model.parameters()).device
    totals = torch.cat([counts.flatten(), calls]).to(device)
    for group in (pg_collection.dp, pg_collection.pp):
        torch.distributed.all_reduce(totals, group=group)
    totals = totals.cpu()
    counts = totals[:counts.numel()].view_as(counts)
    forwards = totals[counts.numel():]
    used = counts.sum(dim=1) > 0
    metrics["moe_max_load"] = float((counts.max(dim=1).values[used]
                                     / counts.mean(dim=1)[used]).max())
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    moe_utils.reduce_aux_losses_tracker_across_ranks(list(tracker), pg_collection=pg_collection)
    # a layer's passes per rank (megatron averages its losses over DP)
    passes = float(forwards[used].mean()) / pg_collection.dp.size() if used.any() else 1.0
    for name, entry in tracker.items():
        values = entry["values"].detach().cpu()
        key = "moe_z_loss" if name == "z_loss" else "moe_load_balancing_loss"
        metrics[key] = float(values.sum() / (int(used.sum()) * passes))
