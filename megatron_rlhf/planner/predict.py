"""Predict one PPO step of a placement plan: samples/s, seconds per stage, memory, bottleneck.

    plan = plan_placement(homogeneous_cluster("A100-80GB", 2, 8),
                          PlacementConfig("interleaving", tp=4), "llama-13b")
    prediction = predict_step(plan, RolloutSpec(batch=1024, prompt_length=256))
    prediction.samples_per_s, prediction.stage_seconds, prediction.bottleneck

The step is the engine's program: generation on the generating models; transfers of the rollout
to the experience models; their forward passes (policy log-probs, values, ref log-probs,
rewards); transfers of the experience to the trainers; training of actor and critic; weight sync
into the shadows. ``planner.schedule`` decides what runs side by side from the ranks each task
needs; the formulas are in ``planner.cost_model``, the memory checks in ``planner.memory``.

Overlap per strategy: flattening runs everything in turn; interleaving runs ref || reward;
interleaving2 also actor-train || critic-train; separation and hetero-separation (with
``rollout.overlap``) generate and score rollout k+1 on the inference devices while the trainers
train on rollout k, so the step is the busier side plus the weight sync; hetero-separation also
generates on the trainers' pool, with batch shares by ``relative_speed``. Partial rollouts,
answers that go on across steps and the proximal forward of an off-policy correction are priced
as ``planner.asynchronous`` says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

from megatron_rlhf.planner import asynchronous
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.hardware import HardwareProfile, resolve_profiles
from megatron_rlhf.planner.memory_fit import (
    MEMORY_OPTIONS,
    MemoryOptions,
    MemoryReport,
    RoleMemory,
    experience_passes,
    experience_roles,
    fit_memory,
    generating_roles,
    generation_rows,
    plan_memory,
    pool_of_replicas,
    role_state,
)
from megatron_rlhf.planner.schedule import Schedule, SharedHost, Task, covered_seconds, schedule
from megatron_rlhf.planner.workload import RolloutSpec
from megatron_rlhf.topology.models import (
    ACTOR,
    SHADOW_ACTOR,
    SHADOW_OF,
    TRAINABLE_ROLES,
    VALUE_HEAD_ROLES,
)
from megatron_rlhf.topology.plan import ModelPlacement, PlacementPlan

GENERATION, EXPERIENCE, TRAINING, TRANSFER, SYNC = (
    "generation", "experience", "training", "transfer", "sync")
STAGES = (GENERATION, EXPERIENCE, TRAINING, TRANSFER, SYNC)
BOTTLENECKS = ("memory", "generation", "communication", "compute")
"""memory: offloading, or the plan does not fit; generation: decode and prefill; communication:
collectives, transfers and weight sync; compute: experience and training passes."""


@dataclass(frozen=True)
class StepPrediction:
    """The predicted cost of one PPO step.

    Attributes:
        feasible: the plan fits in memory; otherwise ``problems`` says why and times are 0.
        samples_per_s: prompts (with their responses) per second.
        step_seconds: seconds per step (pipelined when ``pipelined``, else synchronous).
        synchronous_step_seconds: the step with no overlap between consecutive steps.
        pipelined: consecutive steps overlap (separation strategies with ``rollout.overlap``).
        stage_seconds: wall-clock seconds during which each stage runs (synchronous schedule).
        tasks: every task with its start, seconds and breakdown.
        bottleneck: one of ``BOTTLENECKS``: what most of the critical work waits on.
        bottleneck_share: its share of the critical work.
        memory: the memory report (per model, peak, largest batch).
        problems: why the plan cannot run, each with a fix.
        mode: the schedule priced (``asynchronous.MODES``).
    """

    feasible: bool
    samples_per_s: float
    step_seconds: float
    synchronous_step_seconds: float
    pipelined: bool
    stage_seconds: dict[str, float]
    tasks: tuple[dict, ...]
    bottleneck: str
    bottleneck_share: float
    memory: MemoryReport
    problems: tuple[str, ...] = ()
    mode: str = asynchronous.SYNCHRONOUS

    def to_dict(self) -> dict:
        """JSON-ready description; the keys are documented in ``docs/planner.md``."""
        memory = self.memory
        feasible = self.feasible
        return {
            "feasible": feasible,
            "samples_per_s": round(self.samples_per_s, 4),
            "step_seconds": round(self.step_seconds, 4) if feasible else None,
            "synchronous_step_seconds": (round(self.synchronous_step_seconds, 4) if feasible
                                         else None),
            "pipelined": self.pipelined,
            "mode": self.mode,
            "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()},
            "bottleneck": self.bottleneck,
            "bottleneck_share": round(self.bottleneck_share, 3),
            "memory_options": {role: {**o.to_dict(), "label": o.label}
                               for role, o in memory.options.items()},
            "memory_gib": {role: _role_memory_dict(m) for role, m in memory.roles.items()},
            "peak_gib_per_device": round(memory.peak_gib, 2),
            "usable_gib_per_device": round(memory.usable_gib, 2),
            "host_gib_per_node": round(memory.host_gib, 2),
            "largest_batch": memory.largest_batch,
            "largest_micro_batch": dict(memory.largest_micro_batch),
            "sequences_per_round": dict(memory.sequences_per_round),
            "generation_micro_batch": dict(memory.generation_micro_batch),
            "tasks": list(self.tasks),
            "problems": list(self.problems),
        }


def _role_memory_dict(memory: RoleMemory) -> dict:
    values = {f.name: round(getattr(memory, f.name), 3) for f in fields(memory)
              if f.name != "offloaded"}
    return {**values, "total": round(memory.total, 3), "offloaded": memory.offloaded}


def predict_step(plan: PlacementPlan, rollout: RolloutSpec,
                 profiles: Mapping[str, HardwareProfile] | HardwareProfile | None = None,
                 memory_options: tuple[str, ...] = MEMORY_OPTIONS,
                 options: Mapping[str, MemoryOptions] | None = None,
                 stage_scale: Mapping[str, float] | None = None) -> StepPrediction:
    """Predict one PPO step of ``plan``.

    Args:
        plan: a validated placement (``plan_placement``).
        rollout: the step's shapes.
        profiles: device profiles (see ``hardware.resolve_profiles``); default: the shipped
            profile named like each pool's kind.
        memory_options: the memory options the planner may add (``memory.MEMORY_OPTIONS``;
            ``("offload",)`` for what the engine runs today).
        options: every placed model's memory options, fixed (a configured run's own, shadows
            included); the planner then adds none of ``memory_options``, and the plan is
            infeasible when these do not fit.
        stage_scale: a factor per stage (``STAGES``) on the seconds of its tasks, before they
            are scheduled: a calibration from measured stage times (``planner.replan``).

    Returns:
        The prediction; an infeasible plan gives ``feasible=False``, zero throughput, the
        ``memory`` bottleneck and the reasons in ``problems``.

    Raises:
        ValueError: a pool has no profile.
    """
    hardware = resolve_profiles(plan.cluster, profiles)
    ctx = _Context(plan, rollout, hardware)
    memory = (fit_memory(plan, rollout, hardware, ctx.option_seconds, memory_options)
              if options is None else plan_memory(plan, rollout, hardware, dict(options)))
    if memory.problems:
        return StepPrediction(False, 0.0, math.inf, math.inf, False, {}, (), "memory", 1.0,
                              memory, tuple(memory.problems))
    hosts = [SharedHost(range(node.first_rank, node.first_rank + node.size),
                        hardware[node.pool_index].host_cores)
             for node in plan.cluster.nodes() if hardware[node.pool_index].host_cores > 0]
    scale = stage_scale or {}
    tasks = [replace(task, cost=task.cost.scaled(scale.get(task.stage, 1.0)))
             for task in build_tasks(ctx, memory)]
    result = schedule(tasks, hosts)
    pipelined = ctx.pipelined
    step = result.period if pipelined else result.makespan
    chain = result.busiest if pipelined else result.critical
    bottleneck, share = _bottleneck([result.tasks[i] for i in chain])
    return StepPrediction(
        feasible=True, samples_per_s=rollout.batch / step, step_seconds=step,
        synchronous_step_seconds=result.makespan, pipelined=pipelined,
        stage_seconds=_stage_seconds(result), tasks=_task_rows(result),
        bottleneck=bottleneck, bottleneck_share=share, memory=memory,
        mode=asynchronous.rollout_mode(rollout, pipelined),
    )


class _Context:
    """What pricing the tasks needs: the plan, shapes, profiles, and the stage costs of a model
    under given memory options."""

    def __init__(self, plan: PlacementPlan, rollout: RolloutSpec,
                 hardware: tuple[HardwareProfile, ...]) -> None:
        self.plan, self.rollout, self.hardware = plan, rollout, hardware
        self.pipelined = rollout.overlap and plan.config.separated
        """Consecutive steps overlap (asynchronous separation)."""
        self._envs: dict[tuple[str, int, MemoryOptions], cm.ModelEnv] = {}
        """``env``'s answers: fitting memory prices every option of every model, and the links
        each model environment needs take a third of a prediction to find."""

    def profile_of(self, rank: int) -> HardwareProfile:
        """The profile of the pool holding global ``rank``."""
        return self.hardware[self.plan.cluster.locate(rank).pool_index]

    def env(self, role: str, pool: int, options: MemoryOptions) -> cm.ModelEnv:
        """``role``'s model as the stage formulas see it, on the devices of ``pool``."""
        key = (role, pool, options)
        if key not in self._envs:
            self._envs[key] = self._env(role, pool, options)
        return self._envs[key]

    def _env(self, role: str, pool: int, options: MemoryOptions) -> cm.ModelEnv:
        model = self.plan[role]
        profile = self.hardware[pool]
        spec = self.plan.cluster.pools[pool]
        tp_link = cm.group_link(spec.intra_node_gbps, spec.inter_node_gbps, False, 1, profile)
        ep = model.spec.ep
        return cm.ModelEnv(model.spec.arch, model.tp, model.pp, model.dp,
                           role in VALUE_HEAD_ROLES, profile, tp_link,
                           self.group_link(model, "pp"), self.group_link(model, "dp"),
                           options.sharding, ep, self.group_link(model, "ep") if ep > 1 else None,
                           model.spec.adapter_params, options.optimizer_offload)

    def group_link(self, model: ModelPlacement, dim: str) -> cm.Link:
        """Link of the model's first ``dim`` group (``tp``, ``pp``, ``dp``, or ``ep``: the first
        ``ep`` ranks of its first DP group, ``topology.experts``), shared by the groups on the
        same node."""
        cluster = self.plan.cluster
        if dim == "ep":
            group = [model.global_rank(dp=e) for e in range(model.spec.ep)]
        else:
            group = model.group_ranks(dim)[0]
        nodes = [cluster.locate(rank).node for rank in group]
        pools = [cluster.pools[cluster.locate(rank).pool_index] for rank in group]
        members_here = nodes.count(nodes[0])
        model_here = sum(1 for rank in model.ranks if cluster.locate(rank).node == nodes[0])
        return cm.group_link(min(p.intra_node_gbps for p in pools),
                             min(p.inter_node_gbps for p in pools), len(set(nodes)) > 1,
                             max(1, model_here // members_here), self.profile_of(group[0]))

    def link_between(self, ranks_a: list[range], ranks_b: list[range]) -> tuple[cm.Link, bool]:
        """Link between two sets of ranks; True when they all lie on one node."""
        cluster = self.plan.cluster
        ranks = [rank for block in ranks_a + ranks_b for rank in (block.start, block.stop - 1)]
        nodes = {cluster.locate(rank).node for rank in ranks}
        pools = [cluster.pools[cluster.locate(rank).pool_index] for rank in ranks]
        one_node = len(nodes) == 1
        gbps = min(p.intra_node_gbps if one_node else p.inter_node_gbps for p in pools)
        profile = self.profile_of(ranks[0])
        return cm.Link(gbps * 1e9 / 8 * profile.link_efficiency,
                       profile.collective_latency_s), one_node

    def per_pool(self, role: str, options: MemoryOptions,
                 cost: Callable[[cm.ModelEnv, int], cm.Cost]) -> cm.Cost:
        """The slowest pool's cost of ``role``, each replica with an even share of the batch."""
        rows = math.ceil(self.rollout.batch / self.plan[role].dp)
        return max((cost(self.env(role, pool, options), rows)
                    for pool in pool_of_replicas(self.plan, role)), key=lambda c: c.total)

    def offload(self, role: str, options: MemoryOptions, training: bool) -> cm.Cost:
        """The copies of an offloaded model around one stage: its weights for generation and
        forward passes, every state for training."""
        if not options.offload:
            return cm.Cost()
        state = role_state(self.plan[role], options)
        nbytes = state.total if training else state.weights
        profile = self.profile_of(self.plan[role].ranks.start)
        return cm.Cost(offload=cm.offload_seconds(nbytes, profile))

    def generation(self, role: str, pool: int, rows: int, options: MemoryOptions,
                   max_sequences: int) -> cm.Cost:
        """Generation of ``rows`` on one replica of ``role`` in ``pool``."""
        rollout, env = self.rollout, self.env(role, pool, options)
        lengths = rollout.answer_lengths
        if self.pipelined and rollout.continue_answers:  # slots kept full across steps
            table = lengths.lengths if lengths is not None else (rollout.generation_length,)
            cost = asynchronous.continued_generation_cost(
                env, table, rows, rollout.prompt_length, max_sequences,
                rollout.stop_check_interval)
        elif lengths is None:
            cost = cm.generation_cost(env, rows, rollout.prompt_length,
                                      rollout.generation_length, max_sequences)
        else:  # the replica holding the step's longest answer: the one the step waits for
            cost = cm.answers_generation_cost(
                env, lengths.replica_queue(rows, rollout.batch), rollout.prompt_length,
                max_sequences, rollout.batching == "continuous", rollout.stop_check_interval)
        return cost + self.offload(role, options, training=False)

    def experience(self, role: str, options: MemoryOptions) -> cm.Cost:
        """The experience forward passes of ``role`` (``memory_fit.experience_passes``)."""
        seq, mbs = self.rollout.priced_sequence_length, self.rollout.micro_batch_size
        passes = self.experience_passes()[role]
        return self.per_pool(role, options, lambda env, rows: cm.forward_cost(
            env, rows, seq, mbs).scaled(passes)) + self.offload(role, options, training=False)

    def experience_passes(self) -> dict[str, int]:
        """``memory_fit.experience_passes`` less the generating policy's when its old log-probs
        are generation's (``RolloutSpec.reuse_logprobs``); a model left with none is absent."""
        passes = experience_passes(self.plan)
        if self.rollout.reuse_logprobs:
            policy = SHADOW_ACTOR if SHADOW_ACTOR in self.plan.models else ACTOR
            passes[policy] -= 1
        return {role: n for role, n in passes.items() if n > 0}

    def proximal(self, options: MemoryOptions) -> cm.Cost:
        """The actor's proximal forward over the step's rows (``RolloutSpec.proximal_forward``),
        each replica its share."""
        seq, mbs = self.rollout.priced_sequence_length, self.rollout.micro_batch_size
        return self.per_pool(ACTOR, options, lambda env, rows: cm.forward_cost(env, rows, seq,
                                                                             mbs))

    def training(self, role: str, options: MemoryOptions) -> cm.Cost:
        """The training of ``role``."""
        r = self.rollout
        return self.per_pool(role, options, lambda env, rows: cm.training_cost(
            env, rows, r.priced_sequence_length, r.micro_batch_size, r.num_minibatches,
            options.recompute, r.ppo_epochs)) + self.offload(role, options, training=True)

    def option_seconds(self, role: str, options: MemoryOptions) -> float:
        """Seconds of every stage ``role`` runs under ``options``: the price ``fit_memory``
        ranks options by. Generation is priced in one round: how many rounds the KV cache
        allows depends on the options of every model on the device."""
        total = cm.Cost()
        for generator, per_pool in generation_rows(self.plan, self.rollout.batch).items():
            if generator == role:
                total += max((self.generation(role, pool, rows, options, rows)
                              for pool, rows in per_pool.items()), key=lambda c: c.total)
        if role in self.experience_passes():
            total += self.experience(role, options)
        if self.plan[role].spec.trainable:
            total += self.training(role, options)
        return total.total


def build_tasks(ctx: _Context, memory: MemoryReport) -> list[Task]:
    """The step's tasks in program order, with their costs and dependencies.

    Each stage first moves its inputs to every model of the stage, then runs the models, so
    that models on disjoint ranks (ref and reward under interleaving) can run side by side.
    """
    plan, rollout, options = ctx.plan, ctx.rollout, memory.options
    seq = rollout.priced_sequence_length
    tasks: list[Task] = []

    def add(task: Task) -> int:
        tasks.append(task)
        return len(tasks) - 1

    generators = generating_roles(plan)
    sources = tuple(plan[role].ranks for role in generators)
    gen = add(Task(f"{GENERATION}:{'+'.join(generators)}", GENERATION, sources,
                   _generation_cost(ctx, memory)))
    payload = rollout.batch * seq * cm.ROLLOUT_BYTES_PER_TOKEN
    inputs = {}
    for role in (r for r in experience_roles(plan) if r in ctx.experience_passes()):
        # A scorer laid out as the one generator (same ranks, same replicas) finds its rows there.
        in_place = (len(generators) == 1 and plan[role].ranks == plan[generators[0]].ranks
                    and plan[role].dp == plan[generators[0]].dp)
        task = None if in_place else _transfer(
            ctx, f"{'+'.join(generators)}->{role}", sources, (plan[role].ranks,), payload,
            cm.ROLLOUT_FIELDS, (gen,))
        inputs[role] = (add(task),) if task else (gen,)
    scored = [add(Task(f"{EXPERIENCE}:{role}", EXPERIENCE, (plan[role].ranks,),
                       ctx.experience(role, options[role]), deps))
              for role, deps in inputs.items()]
    trainers = [role for role in TRAINABLE_ROLES if role in plan.models]
    # Every trainer rank holds every row (advantages are whitened over the whole batch): rows
    # move unless one block of ranks holds every scorer and trainer as a single whole replica.
    involved = [plan[role] for role in (*experience_roles(plan), *trainers)]
    in_place = (len({m.ranks for m in involved}) == 1
                and all(m.dp == 1 and m.pp == 1 for m in involved))
    targets = tuple(sorted({plan[role].ranks for role in trainers}, key=lambda r: r.start))
    scored = scored or [gen]  # nothing scores apart: the rows come from generation
    merged = None if in_place else _transfer(
        ctx, "experience->trainers", tuple(tasks[i].ranges[0] for i in scored), targets,
        rollout.batch * seq * cm.EXPERIENCE_BYTES_PER_TOKEN, cm.EXPERIENCE_FIELDS,
        tuple(scored))
    deps = (add(merged),) if merged else tuple(scored)
    trained = {}
    for role in trainers:
        ready = deps
        if role == ACTOR and rollout.proximal_forward:  # before the actor's first update
            ready = (add(Task(f"{EXPERIENCE}:{role} (proximal)", EXPERIENCE,
                              (plan[role].ranks,), ctx.proximal(options[role]), deps)),)
        trained[role] = add(Task(f"{TRAINING}:{role}", TRAINING, (plan[role].ranks,),
                                 ctx.training(role, options[role]), ready))
    for shadow, trainer in SHADOW_OF.items():
        if shadow in plan.models:
            add(_sync(ctx, trainer, shadow, (trained[trainer],)))
    return tasks


def _generation_cost(ctx: _Context, memory: MemoryReport) -> cm.Cost:
    """The slowest generating replica group (role, pool), each with its speed-weighted rows."""
    return max((ctx.generation(role, pool, rows, memory.options[role],
                               memory.sequences_per_round[role])
                for role, per_pool in generation_rows(ctx.plan, ctx.rollout.batch).items()
                for pool, rows in per_pool.items()), key=lambda c: c.total)


def _transfer(ctx: _Context, name: str, sources: tuple[range, ...], targets: tuple[range, ...],
              payload: float, fields: int, deps: tuple[int, ...]) -> Task:
    """Rows of ``fields`` fields (``payload`` bytes) moved from ``sources`` to ``targets``."""
    link, _ = ctx.link_between(list(sources), list(targets))
    ranges = tuple(dict.fromkeys((*sources, *targets)))  # each block once
    return Task(f"{TRANSFER}:{name}", TRANSFER, ranges,
                cm.Cost(comm=cm.transfer_seconds(payload, fields, link)), deps)


def _sync(ctx: _Context, trainer: str, shadow: str, deps: tuple[int, ...]) -> Task:
    """Weight sync of ``trainer`` into ``shadow`` (``cost_model.weight_sync_seconds``): per
    device over NVLink when both sit on one node, else per node over the network."""
    source, target = ctx.plan[trainer], ctx.plan[shadow]
    link, one_node = ctx.link_between([source.ranks], [target.ranks])
    cluster = ctx.plan.cluster
    if one_node:
        receivers, senders = target.size, source.size
    else:
        receivers, senders = (len({cluster.locate(r).node for r in m.ranks})
                              for m in (target, source))
    # the shadow's devices each receive their shard: experts split over its ep as well; with
    # LoRA every sync after the first moves the adapters alone (the frozen base moved once)
    params = target.spec.adapter_params or target.spec.device_params() * target.tp * target.pp
    seconds = cm.weight_sync_seconds(params, target.tp, target.pp,
                                     target.size, receivers, senders, link)
    return Task(f"{SYNC}:{trainer}->{shadow}", SYNC, (source.ranks, target.ranks),
                cm.Cost(comm=seconds), deps)


def _stage_seconds(result: Schedule) -> dict[str, float]:
    """Per stage, the length of the union of its tasks' intervals."""
    return {stage: covered_seconds((result.start[i], result.end[i])
                                   for i, task in enumerate(result.tasks) if task.stage == stage)
            for stage in STAGES}


def _task_rows(result: Schedule) -> tuple[dict, ...]:
    return tuple(
        {"name": task.name, "stage": task.stage, "start_s": round(result.start[i], 4),
         "seconds": round(task.cost.total, 4),
         **{f"{f.name}_s": round(getattr(task.cost, f.name), 4) for f in fields(task.cost)}}
        for i, task in enumerate(result.tasks))


def _bottleneck(tasks: list[Task]) -> tuple[str, float]:
    """The category with the most seconds among ``tasks`` (the critical work), and its share."""
    seconds = dict.fromkeys(BOTTLENECKS, 0.0)
    for task in tasks:
        cost = task.cost
        seconds["memory"] += cost.offload
        seconds["communication"] += cost.comm
        work = cost.compute + cost.memory + cost.overhead
        seconds["generation" if task.stage == GENERATION else "compute"] += work
    total = sum(seconds.values())
    name = max(BOTTLENECKS, key=lambda key: seconds[key])
    return name, seconds[name] / total if total else 0.0
