"""``run_ppo.py --plan-only``: a run's plan and the planner's prediction, without running it.

    cluster = plan_cluster(config, nodes=16, gpus_per_node=8)    # or config.cluster.pools
    run_plan = plan_run(config, cluster)
    print(run_plan.format()); run_plan.fits; run_plan.to_dict()

It builds, in one process on a CPU and for any world size, what every rank of the run would
build first: the placement (``make_plan``: ranks, TP/PP/DP, the batch-shape checks), each
model's process groups as rank lists, the memory options the run configures (the distributed
optimizer or FSDP, ``models.recompute``, ``models.offload`` with ``auto`` decided as the engine
decides it), and the planner's prediction under exactly those options (``planner.predict_step``):
memory per GPU per model, seconds per stage and per step. Nothing is launched and no weights are
read: the architecture is that of the initial checkpoints when every configured one exists
(their ``config.json`` or ``megatron_rlhf.json``), else ``models.arch``.

A micro-batch is priced as the run fills it (``micro_batching.planner_rollout``): with
``rollout.max_tokens_per_micro_batch`` a number, that many tokens; with ``auto`` the budget the
run would choose (``micro_batching.token_budgets``: on each model's first rank, with its pool's
device memory), the smallest model's; padded rows, ``rollout.micro_batch_size`` rows.

Answers are priced at ``generation.max_new_tokens`` each unless a length distribution is given
(:func:`answer_lengths`: a stated mean and maximum, or a file of answer lengths or reference
answers); the plan prints the assumption it used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rlhf.builder.sources import initial_checkpoints, resolve_sources
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.auto_placement import answered_rollout, choose_placement
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.engine.run.micro_batching import planner_rollout, token_budgets
from megatron_rlhf.engine.run.stage_memory import offload_policies
from megatron_rlhf.planner import (
    AnswerLengths,
    MemoryOptions,
    RolloutSpec,
    StepPrediction,
    load_profile,
    predict_step,
    shipped_profiles,
)
from megatron_rlhf.planner.asynchronous import describe_mode
from megatron_rlhf.planner.cost_model import DISTRIBUTED_OPTIMIZER, FULLY_SHARDED, REPLICATED
from megatron_rlhf.planner.report import format_prediction
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.experts import expert_rank_enums
from megatron_rlhf.topology.models import SHADOW_OF, TRAINABLE_ROLES
from megatron_rlhf.topology.plan import PlacementPlan
from megatron_rlhf.topology.render import format_summary

DEFAULT_GPU = "A100-80GB"
"""The device kind of ``--nodes``/``--gpus-per-node`` when the configuration names none (the
default of ``tools/plan_placement.py``)."""

GROUP_DIMS = ("tp", "pp", "dp")
EXPERT_GROUP_DIMS = ("ep", "expt_dp")


def plan_cluster(config: RunConfig, nodes: int | None = None, gpus_per_node: int | None = None,
                 gpu: str | None = None) -> ClusterSpec:
    """The cluster to plan for: ``nodes`` x ``gpus_per_node`` devices of kind ``gpu`` (a shipped
    profile name, with its memory and link figures), or the configured ``cluster.pools``.

    ``gpu`` defaults to the kind of the configured pool when there is one, else
    :data:`DEFAULT_GPU`; ``nodes`` and ``gpus_per_node`` default to that pool's.

    Raises:
        ValueError: no cluster given at all, several configured pools to reshape, or an
            unknown device kind.
    """
    pools = list(config.cluster.pools)
    if nodes is None and gpus_per_node is None and gpu is None:
        if not pools:
            raise ValueError("--plan-only needs the cluster to plan for: set cluster.pools in "
                             "the config, or give --nodes N --gpus-per-node G [--gpu KIND]")
        return ClusterSpec(tuple(pools))
    if len(pools) > 1:
        raise ValueError(f"--nodes/--gpus-per-node/--gpu reshape one pool, but cluster.pools "
                         f"has {len(pools)} ({[p.kind for p in pools]}): edit cluster.pools")
    pool = pools[0] if pools else None
    kind = gpu or (pool.kind if pool else DEFAULT_GPU)
    nodes = nodes or (pool.nodes if pool else 1)
    gpus_per_node = gpus_per_node or (pool.devices_per_node if pool else None)
    if gpus_per_node is None:
        raise ValueError("--nodes without cluster.pools needs --gpus-per-node too")
    if kind not in shipped_profiles():
        raise ValueError(f"--gpu {kind!r} is not a shipped profile: use one of "
                         f"{sorted(shipped_profiles())}, or describe the devices in cluster.pools "
                         "and pass --profile PATH (tools/calibrate.py writes one)")
    return ClusterSpec((load_profile(kind).pool(nodes, gpus_per_node),))


def plan_architectures(config: RunConfig) -> tuple[dict[str, Any], str]:
    """The initial checkpoints to plan from, read without their weights, and where the
    architecture comes from: every configured checkpoint when all of them exist, else none
    (``models.arch``), so that a recipe plans before its checkpoints are downloaded."""
    paths = initial_checkpoints(config)
    if not paths:
        return {}, f"models.arch ({_arch_label(config)})"
    missing = sorted({path for path in paths.values() if not Path(path).exists()})
    if missing:
        return {}, (f"models.arch ({_arch_label(config)}); checkpoints not found, so not read: "
                    f"{', '.join(missing)}")
    return resolve_sources(config), "the checkpoints' configs: " + ", ".join(sorted(set(paths.values())))


def _arch_label(config: RunConfig) -> str:
    arch = config.models.arch
    return arch if isinstance(arch, str) else str(dict(arch).get("name", "custom"))


def run_memory_options(config: RunConfig, plan: PlacementPlan) -> dict[str, MemoryOptions]:
    """Every placed model's memory options as the run configures them: sharding from
    ``<role>_optimizer`` (FSDP, distributed optimizer), recomputation from ``models.recompute``
    (``selective`` is priced as none: the planner's recomputation is every layer's), offloading
    from ``models.offload`` (``auto`` decided as the engine does), the optimizer on the host from
    ``<role>_optimizer.cpu_offload_fraction=1`` (a smaller share is priced as none); a shadow
    follows its model."""
    offload = offload_policies(config, plan)
    options = {}
    for role in plan.roles:
        trained = SHADOW_OF.get(role, role)
        if role not in TRAINABLE_ROLES:
            options[role] = MemoryOptions(offload=offload[role] == "always")
            continue
        optimizer = config.optimizer(trained)
        sharding = (FULLY_SHARDED if optimizer.fsdp else DISTRIBUTED_OPTIMIZER
                    if plan[role].spec.distributed_optimizer else REPLICATED)
        options[role] = MemoryOptions(sharding, config.models.recompute_of(role) == "full",
                                      offload[role] == "always",
                                      optimizer.cpu_offload_fraction == 1.0)
    return options


@dataclass(frozen=True)
class RunPlan:
    """What ``--plan-only`` found.

    Attributes:
        config: the run, with the planner's placement under ``--placement auto``.
        plan: the placement.
        rollout: the step's shapes as the planner prices them.
        options: every model's memory options (:func:`run_memory_options`).
        prediction: the planner's prediction under them.
        architecture: where the architecture came from.
        budgets: each model's tokens per micro-batch (:func:`token_budgets`; 0: fixed rows).
        chosen: why the planner chose the placement (``--placement auto``), else empty.
        lengths: the answers' length distribution priced (None: every answer
            ``generation.max_new_tokens`` tokens).
    """

    config: RunConfig
    plan: PlacementPlan
    rollout: RolloutSpec
    options: dict[str, MemoryOptions]
    prediction: StepPrediction
    architecture: str
    budgets: dict[str, int]
    chosen: str = ""
    lengths: AnswerLengths | None = None

    @property
    def fits(self) -> bool:
        """Every device holds what its models need, with the configured memory options."""
        return self.prediction.feasible

    def summary_line(self) -> str:
        """The figures a recipe's header quotes: cluster, peak memory per GPU, step time."""
        pools = " + ".join(f"{p.nodes}x{p.devices_per_node} {p.kind}"
                           for p in self.plan.cluster.pools)
        p, memory = self.prediction, self.prediction.memory
        if not self.fits:
            return f"predicted on {pools}: does not fit in memory"
        return (f"predicted on {pools}: peak {memory.peak_gib:.1f} GiB per GPU of "
                f"{memory.usable_gib:.1f} usable, {p.step_seconds:.1f} s per step "
                f"({p.samples_per_s:.2f} samples/s)")

    def groups(self) -> dict[str, dict[str, list[list[int]]]]:
        """Each model's process groups, as rank lists per dimension (``tp``, ``pp``, ``dp``; with
        expert parallelism also ``ep``, the ranks exchanging tokens, and ``expt_dp``, the ranks
        holding the same experts: ``topology.experts``)."""
        groups = {}
        for role in self.plan.roles:
            model = self.plan[role]
            groups[role] = {dim: model.group_ranks(dim) for dim in GROUP_DIMS}
            if model.spec.ep > 1:
                experts = expert_rank_enums(model.rank_offset, model.tp, model.dp, model.pp,
                                            model.spec.ep)
                groups[role].update({dim: experts[dim] for dim in EXPERT_GROUP_DIMS})
        return groups

    def to_dict(self) -> dict:
        """JSON-ready description: plan, groups, rollout, options, prediction, summary."""
        prediction = self.prediction.to_dict()
        prediction.pop("tasks")
        return {"summary": self.summary_line(), "fits": self.fits,
                "architecture": self.architecture, "chosen": self.chosen or None,
                "tokens_per_micro_batch": self.budgets,
                "plan": self.plan.to_dict(), "groups": self.groups(),
                "rollout": self.rollout.to_dict(), "prediction": prediction}

    def to_json(self) -> str:
        """:meth:`to_dict` as one line."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def format(self) -> str:
        """The plan for a person: models, groups, stage times, memory per GPU per model."""
        r = self.rollout
        budget = self.config.rollout.max_tokens_per_micro_batch
        priced = "" if not budget else f" (max_tokens_per_micro_batch={budget} priced as rows)"
        lines = [f"architecture: {self.architecture}",
                 f"rollout: {r.batch} rows of {r.prompt_length} + {r.generation_length} tokens, "
                 f"micro-batches of {r.micro_batch_size} rows{priced}",
                 "answer lengths: " + (self.lengths.describe() if self.lengths else
                                       f"every answer {r.generation_length} tokens "
                                       "(generation.max_new_tokens; --answer-mean prices a "
                                       "distribution)"),
                 "schedule: " + describe_mode(r, self.prediction.pipelined),
                 "tokens per micro-batch: " + ", ".join(
                     f"{role} {tokens or 'fixed rows'}" for role, tokens in self.budgets.items())]
        lora = self.config.models.lora
        if lora.enabled:
            lines.append(f"lora: rank {lora.rank} adapters, trained alone, on " + ", ".join(
                f"{role} ({model.spec.adapter_params / 1e6:.1f}M of "
                f"{model.spec.num_params() / 1e9:.2f}B parameters)"
                for role, model in self.plan.models.items() if lora.applies_to(role))
                + ("; the actor's base is the reference (no reference model)"
                   if lora.applies_to("actor") else "")
                + ("; weight syncs after the first move the adapters alone"
                   if self.plan.config.separated else ""))
        if self.chosen:
            lines.append(f"placement auto: {self.chosen}")
        lines += ["", format_summary(self.plan), "",
                  f"{'process groups':<14} {'dim':<7} {'groups':>6} {'size':>5}  first"]
        for role, dims in self.groups().items():
            for dim, groups in dims.items():
                first = groups[0]
                span = (f"[{first[0]}, {first[-1]}]" if len(first) > 2 else str(first))
                stride = f" step {first[1] - first[0]}" if len(first) > 2 else ""
                lines.append(f"{role:<14} {dim:<7} {len(groups):>6} {len(first):>5}  "
                             f"{span}{stride}")
        lines += ["", format_prediction(self.prediction), "", self.summary_line()]
        return "\n".join(lines)


def plan_run(config: RunConfig, cluster: ClusterSpec, profile: str | None = None,
             auto: bool = False, lengths: AnswerLengths | None = None) -> RunPlan:
    """The plan and prediction of ``config`` on ``cluster`` (module docstring).

    Args:
        config: the run.
        cluster: the devices (:func:`plan_cluster`).
        profile: a hardware profile name or JSON path for every pool; None: the shipped profile
            named like each pool's kind.
        auto: let the planner choose the placement first (``--placement auto``).
        lengths: the answers' length distribution (:func:`answer_lengths`); None: every answer
            ``generation.max_new_tokens`` tokens.

    Raises:
        ValueError: a placement the run cannot use (named as ``make_plan`` names it), a pool
            without a profile, or an unreadable checkpoint config.
    """
    chosen = ""
    if auto:
        config, chosen = choose_placement(config, cluster, profile, lengths)
    sources, architecture = plan_architectures(config)
    plan = make_plan(config, cluster, sources)
    budgets = token_budgets(config, plan)
    rollout = planner_rollout(config, budgets, answered_rollout(config, lengths))
    options = run_memory_options(config, plan)
    prediction = predict_step(plan, rollout, load_profile(profile) if profile else None,
                              options=options)
    return RunPlan(config, plan, rollout, options, prediction, architecture, budgets, chosen,
                   lengths)


def answer_lengths(config: RunConfig, mean: float | None = None, maximum: int | None = None,
                   path: str | None = None) -> AnswerLengths | None:
    """The answers' length distribution for ``--plan-only``, capped at
    ``generation.max_new_tokens``: from ``path`` (one answer per line: a token count, or a JSON
    object with a numeric ``tokens`` field, or with a reference answer's text in ``response`` or
    ``answer``, counted in the run's tokenizer's tokens), else exponential answers of ``mean``
    tokens cut at ``maximum`` (default the cap; ``AnswerLengths.from_mean_max``); None when
    neither is given.

    Raises:
        ValueError: naming the flag: a maximum above ``generation.max_new_tokens``, a maximum
            without a mean, both a mean and a file, or an unreadable file.
    """
    cap = config.generation.max_new_tokens
    if path is not None and (mean is not None or maximum is not None):
        raise ValueError("--answer-lengths takes the lengths from its file: drop --answer-mean "
                         "and --answer-max")
    if path is not None:
        lengths, texts = _read_lengths(path, lambda: _token_counter(config))
        what = "reference answers" if texts else "answer lengths"
        return AnswerLengths.from_samples(lengths, cap, f"{what} of {path}")
    if mean is None:
        if maximum is not None:
            raise ValueError("--answer-max needs --answer-mean (the mean answer, in tokens)")
        return None
    maximum = cap if maximum is None else maximum
    if not 1 <= maximum <= cap:
        raise ValueError(f"--answer-max {maximum} must be in [1, generation.max_new_tokens="
                         f"{cap}]: raise generation.max_new_tokens or lower --answer-max")
    if not 1 <= mean <= maximum:
        raise ValueError(f"--answer-mean {mean:g} must be in [1, --answer-max {maximum}]")
    found = AnswerLengths.from_mean_max(mean, maximum)
    return AnswerLengths(found.lengths, cap, found.source)


ANSWER_TEXT_FIELDS = ("response", "answer")
"""Fields of a JSON line whose text is a reference answer, in the order tried."""


def _read_lengths(path: str, counter: Callable[[], Callable[[str], int]]
                  ) -> tuple[list[float], int]:
    """Answer lengths from ``path`` (see :func:`answer_lengths`), and how many were texts;
    ``counter`` gives the token counter, built at the first text."""
    lengths, texts, count = [], 0, None
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
            text = next((value[k] for k in ANSWER_TEXT_FIELDS if isinstance(value, dict)
                         and isinstance(value.get(k), str)), None)
            if text is not None:
                count = count or counter()
                lengths.append(float(count(text)))
                texts += 1
                continue
            value = value["tokens"] if isinstance(value, dict) else value
            lengths.append(float(value))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--answer-lengths {path} line {number}: {line[:60]!r} is not a "
                             "token count, nor a JSON object with a numeric \"tokens\" field or "
                             "an answer's text in \"response\" or \"answer\"") from None
    if not lengths:
        raise ValueError(f"--answer-lengths {path} holds no answer lengths")
    return lengths, texts


def _token_counter(config: RunConfig) -> Callable[[str], int]:
    """Tokens of a text in the run's tokenizer (``runner.run_tokenizer``; imported here, so a
    plan without reference answers loads no tokenizer)."""
    from megatron_rlhf.engine.run.runner import run_tokenizer

    tokenizer = run_tokenizer(config, plan_architectures(config)[0])
    return lambda text: len(tokenizer.encode(text))
