"""The configuration of a PPO run: one typed dataclass per component, composed in ``RunConfig``.

YAML files in ``examples/`` are thin instances of ``RunConfig``; ``megatron_rlhf.config`` loads
them (with inheritance and dotted overrides) and every dataclass validates itself on construction.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Any, ClassVar

from megatron_rlhf.algorithms import PPOAlgorithmConfig, critic_free_estimators
from megatron_rlhf.config.paths import check_paths
from megatron_rlhf.data import ReaderConfig, SplitConfig, SyntheticTaskConfig
from megatron_rlhf.generation import GenerationConfig
from megatron_rlhf.models.hf_import import checkpoint_moe, is_hf_dir
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.models.options import (
    ATTENTION_BACKENDS,
    RECOMPUTE_GRANULARITIES,
    TRANSFORMER_IMPLS,
    LoRAConfig,
    OptimizerSettings,
    resolve_params_dtype,
)
from megatron_rlhf.models.tokenizer import TokenizerConfig
from megatron_rlhf.refit.verify import RefitConfig
from megatron_rlhf.rewards import ON_ERROR_POLICIES, RewardFunctionSpec, parse_reward_functions
from megatron_rlhf.rewards.environments import EnvironmentSpec, parse_environment
from megatron_rlhf.rewards.overlong import OverlongPenalty
from megatron_rlhf.rewards.tools import TOOL_ON_ERROR, ToolSpec, parse_tools
from megatron_rlhf.runtime.bootstrap import RuntimeConfig
from megatron_rlhf.runtime.faults import FaultConfig
from megatron_rlhf.topology.cluster import DevicePool
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_ACTOR,
    SHADOW_OF,
    TRAINABLE_ROLES,
    resolve_arch,
)
from megatron_rlhf.topology.placement_config import PlacementConfig

OFFLOAD_ROLES = (ACTOR, CRITIC, REF, REWARD)
TOKEN_BUDGET_AUTO = "auto"
EPISODE_TOKENS_AUTO = "auto"
OFFLOAD_POLICIES = ("never", "always", "auto")


@dataclass
class ModelsConfig:
    """Which networks the four roles are.

    Attributes:
        arch: architecture preset name (``tiny``, ``small``, ``llama-7b``, ...) or a mapping of
            the architecture's fields (``topology.models.resolve_arch``); ignored when
            ``actor_checkpoint`` is given (the architecture is the checkpoint's).
        init_seed: seed of the layout-independent initialisation when no checkpoint is given.
        actor_checkpoint: checkpoint directory of the initial policy (SFT): a megatron_rlhf
            checkpoint or a Hugging Face ``...ForCausalLM`` directory; or empty.
        reward_checkpoint: checkpoint directory of the reward model: a megatron_rlhf checkpoint
            or a Hugging Face ``...ForSequenceClassification`` directory; or empty. Refused with
            ``reward.model_weight=0``, which runs no reward model.
        critic_from_reward: initialise the critic from the reward model (InstructGPT); else from
            ``init_seed``.
        params_dtype: ``auto`` (``bfloat16`` with CUDA, ``float32`` on CPU), ``float32`` or
            ``bfloat16``; ``auto`` is resolved when the config is built, so the run directory's
            ``config.yaml`` records what ran.
        transformer_impl: layer implementation: ``local`` (megatron's modules), ``transformer_engine``
            or ``auto`` (TE when importable on CUDA, for models that do not decode with the KV
            cache; see ``models.gpt.resolve_transformer_impl``).
        attention_backend: core attention of the ``local`` implementation: ``sdpa`` (torch's
            fused scaled-dot-product attention) or ``megatron`` (its ``DotProductAttention``,
            which materialises the score matrix; for comparison).
        packed_sequences: every full forward (log-probs, values, scores, training) packs each
            micro-batch's real tokens into one row with sequence boundaries and computes no
            padding (``models.packing``); needs ``attention_backend=sdpa`` (or Transformer
            Engine). false: the padded rows, as generation lays them out.
        sequence_parallel: megatron's sequence parallelism for every model with TP > 1 when
            ``packed_sequences`` is on (ignored otherwise): norms, dropout and residuals hold
            ``1/tp`` of the sequence; generation runs without it.
        dropout: hidden and attention dropout of every model (PPO usually runs with 0; with
            dropout the log-probs of the experience and training passes differ by noise).
        hf_cache_dir: where Hugging Face checkpoints given as ``actor_checkpoint`` or
            ``reward_checkpoint`` are converted to (by rank 0), once per checkpoint content;
            every rank must see it (on a multi-node job, a shared filesystem: the default under
            ``~/.cache`` is refused when some rank does not see rank 0's files). Or convert ahead
            of time with ``tools/convert_hf_to_megatron.py`` and name its output instead.
        export_hf: also write the trained actor (``lm`` head) and critic (``scalar`` head) as
            Hugging Face directories, ``<run_dir>/hf/step_<k>/{actor,critic}``, at every
            checkpoint save and after the last step.
        offload: per role (``actor``, ``critic``, ``ref``, ``reward``; a shadow follows the
            model it copies), ``never``, ``always`` or ``auto``: keep the model's weights,
            gradient buffers and optimizer state in host memory between the stages that use
            them (``models.offload.ref=always``; see ``models/offload.py``); ``auto`` does so
            only when a rank of the model is predicted to exceed ``memory_budget_gib`` with it
            resident (``engine/run/stage_memory.py``).
        memory_budget_gib: the memory one rank may use, GiB, for ``offload=auto``; 0: the device
            memory of the rank's pool (``cluster.pools``).
        recompute: per trained role (``actor``, ``critic``), activation recomputation in its
            training passes: ``none``, ``selective`` (the core attention) or ``full`` (every
            layer), e.g. ``models.recompute.actor=full`` (``models.gpt.ModelBuildOptions``).
            Inference-only models keep no activations for a backward pass and never recompute.
        moe: mixture-of-experts MLPs in every model (``models.moe.MoEConfig``:
            ``models.moe.num_experts=8 models.moe.topk=2``); ``num_experts=0``: dense. A
            Hugging Face ``actor_checkpoint`` (else ``reward_checkpoint``) gives its experts
            (``num_experts``, ``topk``, ``ffn_hidden_size``, ``shared_expert_ffn_size``,
            ``renormalize_topk``) as it gives the architecture: a setting left at its default
            takes the checkpoint's value, one set to another value is refused naming both. The
            experts of every other source (a megatron_rlhf MoE checkpoint) must be these; the
            error of a mismatch lists the settings that match. Not with ``export_hf``.
        lora: low-rank adapters on the actor (and optionally the critic) instead of training
            every weight (``models.lora.LoRAConfig``: ``models.lora.rank=8
            models.lora.alpha=16``); ``rank=0``: full training. With adapters on the actor
            the reference log-probs are the actor's with its adapters switched off. Needs
            ``transformer_impl`` ``local`` or ``auto`` (which then builds the adapted roles with
            the local layers).
    """

    arch: Any = "tiny"
    init_seed: int = 1234
    actor_checkpoint: str = ""
    reward_checkpoint: str = ""
    critic_from_reward: bool = True
    params_dtype: str = "auto"
    transformer_impl: str = "auto"
    attention_backend: str = "sdpa"
    packed_sequences: bool = True
    sequence_parallel: bool = True
    dropout: float = 0.0
    hf_cache_dir: str = "~/.cache/megatron_rlhf/converted"
    export_hf: bool = False
    offload: dict[str, str] = field(default_factory=dict)
    memory_budget_gib: float = 0.0
    recompute: dict[str, str] = field(default_factory=dict)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        resolve_arch(self.arch)
        if self.lora.enabled and self.transformer_impl == "transformer_engine":
            raise ValueError("models.lora.rank > 0 puts adapters on megatron's local linear "
                             "layers; set models.transformer_impl=local (or auto)")
        self._read_checkpoint_experts()
        if self.moe.enabled and self.export_hf:
            raise ValueError(f"models.export_hf=true with models.moe.num_experts="
                             f"{self.moe.num_experts}: the run's export does not gather "
                             "the experts of expert-parallel ranks; set export_hf=false and "
                             "convert a model checkpoint of the run with "
                             "tools/convert_megatron_to_hf.py (Qwen3-MoE, Mixtral)")
        for role, granularity in self.recompute.items():
            if role not in TRAINABLE_ROLES:
                raise ValueError(f"models.recompute.{role}: only trained models recompute "
                                 f"activations; use one of {TRAINABLE_ROLES}")
            if granularity not in RECOMPUTE_GRANULARITIES:
                raise ValueError(f"models.recompute.{role}={granularity!r}: use one of "
                                 f"{RECOMPUTE_GRANULARITIES}")
        self.params_dtype = resolve_params_dtype(self.params_dtype)
        for role, policy in self.offload.items():
            if role not in OFFLOAD_ROLES:
                raise ValueError(f"models.offload.{role}: unknown role; use one of {OFFLOAD_ROLES}")
            if policy not in OFFLOAD_POLICIES:
                raise ValueError(f"models.offload.{role}={policy!r}: use one of "
                                 f"{OFFLOAD_POLICIES}")
        if not isinstance(self.memory_budget_gib, int | float) or self.memory_budget_gib < 0:
            raise ValueError(f"models.memory_budget_gib={self.memory_budget_gib!r} must be a "
                             "number >= 0 (0: the device memory of each rank's pool)")
        if self.memory_budget_gib and "auto" not in self.offload.values():
            raise ValueError(f"models.memory_budget_gib={self.memory_budget_gib} is used only "
                             "by models.offload.<role>=auto, and no role has it")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"models.transformer_impl={self.transformer_impl!r}: use one of "
                             f"{TRANSFORMER_IMPLS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"models.attention_backend={self.attention_backend!r}: use one of "
                             f"{ATTENTION_BACKENDS}")
        if self.packed_sequences and self.attention_backend == "megatron":
            raise ValueError("models.attention_backend=megatron takes no sequence boundaries; "
                             "set models.packed_sequences=false too (or use sdpa)")

    def _read_checkpoint_experts(self) -> None:
        """Take ``moe``'s expert settings from the run's first source (``actor_checkpoint``,
        else ``reward_checkpoint``) where it is a Hugging Face directory (see ``moe``); any
        other source, or a path that holds none, is checked by ``builder.sources``."""
        for field_ in ("actor_checkpoint", "reward_checkpoint"):
            path = getattr(self, field_)
            if path:
                if is_hf_dir(path):
                    self.moe = checkpoint_moe(self.moe, path, f"models.{field_}")
                return

    def offload_policy(self, role: str) -> str:
        """The offload policy of ``role`` (a shadow takes its trained model's); ``auto`` is
        decided per placed model by ``engine.run.stage_memory.offload_policies``."""
        return self.offload.get(SHADOW_OF.get(role, role), "never")

    def recompute_of(self, role: str) -> str:
        """The activation recomputation of ``role``'s model (``none`` for inference-only ones,
        shadows included)."""
        return self.recompute.get(role, "none")


@dataclass
class RolloutConfig:
    """Shapes of one PPO step.

    Attributes:
        prompts_per_step: prompts generated per step; the experience batch is
            ``prompts_per_step * samples_per_prompt`` rows (``rows_per_step``), a multiple of every
            model's DP size and of ``num_minibatches``.
        samples_per_prompt: responses sampled per prompt (``n``), in contiguous rows; each has
            its own sampling noise. grpo and rloo need ``n >= 2`` (the group baseline).
        max_prompt_length: prompts are left-padded (and must fit) to this many tokens.
        micro_batch_size: rows per forward/backward micro-batch on one DP replica.
        ppo_epochs: passes over the experience per step.
        num_minibatches: optimizer steps per epoch (each over ``rows_per_step /
            num_minibatches`` rows).
        pipeline_chunks: the prompts of a step go through generation and experience in this
            many chunks, so that scoring chunk i overlaps generating chunk i+1 where the models
            sit on different ranks. Results do not depend on it.
        async_rollout: separation only: the shadows generate step k + max_staleness while the
            trainable models train on step k (off-policy by that many steps).
        max_staleness: steps between producing experience and training on it when
            ``async_rollout`` is on.
        partial_rollouts: with ``async_rollout``: the shadows take the trained weights at the
            next decode-step boundary of the round they generate instead of after it, the
            unfinished answers going on under them with their tokens and KV cache; each token
            records its weight version (docs/asynchronous.md). Needs ``max_staleness=1`` (>= 2
            with ``continue_answers``), ``reuse_generation_logprobs`` (the behaviour log-probs
            are generation's, per token), one pipeline chunk, no dynamic sampling, tools or environment, and
            continuous batching. The decode step that takes the weights is the first stop check
            after the trainers are done, which timing decides: a run whose answers span an
            update is not reproducible bit for bit (a resume still continues from exactly the
            saved state), unless ``partial_handover_check`` fixes it.
        partial_handover_check: with ``partial_rollouts``: 0 (default) takes the weights at the
            first stop check after the trainers are done; n > 0 at the n-th stop check of the
            round, waiting there for the trainers if need be, so that a run (and its resume)
            is reproducible bit for bit at the price of that wait.
        continue_answers: with ``partial_rollouts``: the shadows' answers go on across steps
            (docs/asynchronous.md). Each step's generation call resumes one pool of answers,
            admits the step after next's prompts behind the others, and ends as soon as
            ``prompts_per_step`` whole groups have finished: those, oldest first, are the
            step's experience; the unfinished answers keep their tokens, KV cache, behaviour
            log-probs and versions for the next step. ``max_staleness`` (>= 2 here) then bounds
            the answers trained on (staler ones are dropped, counted in
            ``rollout/dropped_stale``) while the schedule stays one step off. Each generating
            replica needs whole groups; no reward functions and no moves. A checkpoint
            restarts the answers still decoding (saved run and resume continue alike).
        reuse_generation_logprobs: take the old log-probs from generation (the policy
            log-probs of the sampled tokens, computed from the KV-cached decode) instead of a
            full forward of the generating model; saves one of the experience passes. They
            equal the forward's only up to rounding (about 1e-6 on the tiny test model,
            ``tests/engine/test_reuse_generation_logprobs.py``), so it is off by default.
        max_tokens_per_micro_batch: every forward and training pass groups a replica's rows,
            in order, into micro-batches of at most this many real tokens (prompt + response; a
            longer row goes alone) instead of ``micro_batch_size`` rows, like verl's dynamic
            batch size. ``auto`` (default): per model, the largest budget its activations fit
            in beside the states of the models on its device, up to a replica's whole step
            (``engine/run/micro_batching.py``); fixed rows when ``models.packed_sequences`` is
            off. A number > 0 needs ``models.packed_sequences``. 0: fixed ``micro_batch_size``
            rows. Every loss is a per-token sum divided by the step's count, so the update is
            the same either way (up to rounding).
        tools: tools the policy may call, each ``{name: "package.module:function", kwargs:
            {...}}``, called as ``function(arguments, record, **kwargs) -> str`` when a reply
            ends with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the answer
            is appended as a tool message and the policy goes on (docs/howto/train-an-agent.md).
            Checked (imports, signature) when the config is built. Empty: one reply per prompt.
        environment: instead of tools, ``{name: "package.module:Class", kwargs: {...}}``: one
            ``Class(record, **kwargs)`` per episode, ``reset() -> str | None`` (the first user
            message; None: the record's prompt) and ``step(reply) -> (observation, reward,
            done)`` after every reply; the observation is the next user message (None ends the
            episode) and the step rewards are added to the episode's score. Optional keys:
            ``timeout_s`` (default 60), the longest one call (constructing, ``reset``,
            ``step``) may run, and ``on_error``: a call that raises, runs past it or returns
            something else either stops the run naming the environment and the record
            (``error``, the default) or ends that episode, counted in ``rollout/tool_errors``
            (``end``).
        max_turns: replies per episode with ``tools`` or ``environment`` (>= 1); an episode
            whose last allowed reply is answered without ending it stops there, truncated.
        max_episode_tokens: with ``tools`` or ``environment``, the tokens after the prompt
            (replies and answers), the rows' response width; an episode that reaches it ends,
            marked truncated. ``generation.max_new_tokens`` bounds each reply. ``auto``
            (default): room for every reply and, between two replies, an answer as long as a
            prompt: ``max_turns * generation.max_new_tokens + (max_turns - 1) *
            max_prompt_length``, resolved when the config is built (``config.yaml`` records
            the number). Ignored without tools or an environment (``auto`` or 0 there).
        tool_on_error: a call that is not valid JSON, names no tool, or whose tool raises, runs
            past ``tool_timeout_s`` or returns no string: ``observe`` (the policy reads a
            one-line error, counted in ``rollout/tool_errors``) or ``error`` (stop the run).
        tool_timeout_s: the longest one tool call may run, seconds.
        tool_workers: worker processes per generating rank that run the tools.
        overlap_tools: with ``tools``, run the tools' waits beside decoding: each generation
            call takes every episode ready at that moment (new, or its answer back) while the
            others' tools still run, so an episode waiting for its tool holds no decode row;
            worth it when tool latency varies and is of the size of a turn's decoding. The
            sampled tokens are the default loop's (each row's noise is keyed by its own turn),
            but which rows share a batch depends on the tools' timing: log-probs agree with
            the default loop's to rounding only, and a resumed run is not bit-exact. Not with
            ``environment``.
    """

    prompts_per_step: int = 8
    samples_per_prompt: int = 1
    max_prompt_length: int = 16
    micro_batch_size: int = 2
    ppo_epochs: int = 1
    num_minibatches: int = 1
    pipeline_chunks: int = 1
    async_rollout: bool = False
    max_staleness: int = 1
    partial_rollouts: bool = False
    partial_handover_check: int = 0
    continue_answers: bool = False
    reuse_generation_logprobs: bool = False
    max_tokens_per_micro_batch: int | str = TOKEN_BUDGET_AUTO
    tools: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] | None = None
    max_turns: int = 1
    max_episode_tokens: int | str = EPISODE_TOKENS_AUTO
    tool_on_error: str = "observe"
    tool_timeout_s: float = 10.0
    tool_workers: int = 2
    overlap_tools: bool = False

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "max_prompt_length",
                     "micro_batch_size", "ppo_epochs", "num_minibatches", "pipeline_chunks",
                     "max_staleness"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.rows_per_step % self.num_minibatches:
            raise ValueError(f"rollout.prompts_per_step({self.prompts_per_step}) x "
                             f"samples_per_prompt({self.samples_per_prompt}) is not a multiple "
                             f"of rollout.num_minibatches({self.num_minibatches})")
        if self.prompts_per_step % self.pipeline_chunks:
            raise ValueError(f"rollout.prompts_per_step({self.prompts_per_step}) is not a multiple "
                             f"of rollout.pipeline_chunks({self.pipeline_chunks})")
        budget = self.max_tokens_per_micro_batch
        if budget != TOKEN_BUDGET_AUTO and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"rollout.max_tokens_per_micro_batch={budget!r} must be "
                             f"{TOKEN_BUDGET_AUTO!r} (sized to the device) or a token count "
                             ">= 0 (0: fixed micro_batch_size rows)")
        if self.max_staleness != 1 and not self.async_rollout:
            raise ValueError(f"rollout.max_staleness={self.max_staleness} is used only with "
                             "rollout.async_rollout=true; set that too, or drop max_staleness")
        self._check_partial_rollouts()
        self._check_episodes()

    def _check_partial_rollouts(self) -> None:
        """Partial rollouts hand the weights over inside one round of one step's generation."""
        if self.partial_handover_check < 0 or (self.partial_handover_check
                                                and not self.partial_rollouts):
            raise ValueError(f"rollout.partial_handover_check={self.partial_handover_check} "
                             "must be >= 0 and is used only with rollout.partial_rollouts=true")
        if self.continue_answers and not self.partial_rollouts:
            raise ValueError("rollout.continue_answers=true needs rollout.partial_rollouts=true: "
                             "answers that go on across steps take the trained weights between "
                             "decode steps; set it, or continue_answers=false")
        if self.continue_answers and self.max_staleness < 2:
            raise ValueError(f"rollout.continue_answers=true needs rollout.max_staleness >= 2 "
                             f"(got {self.max_staleness}): an answer carried into the next step "
                             "holds tokens two versions older than the step that trains it and "
                             "would always be dropped; e.g. max_staleness=3")
        if not self.partial_rollouts:
            return
        needs = {"async_rollout": (self.async_rollout, "true"),
                 "max_staleness": (self.max_staleness == 1 or self.continue_answers, "1"),
                 "reuse_generation_logprobs": (self.reuse_generation_logprobs, "true"),
                 "pipeline_chunks": (self.pipeline_chunks == 1, "1"),
                 "tools": (not self.tools and self.environment is None, "[] (no episodes)")}
        for name, (ok, value) in needs.items():
            if not ok:
                raise ValueError(f"rollout.partial_rollouts=true needs rollout.{name}={value}: "
                                 "the shadows take new weights inside one generation round of "
                                 "a one-step-off run, and the behaviour log-probs are "
                                 "generation's per token; set it, or partial_rollouts=false")

    def _check_episodes(self) -> None:
        """The tools or the environment import and the episode's bounds fit them."""
        self.environment_spec  # noqa: B018 - checks that the environment imports
        if self.tool_specs and self.environment is not None:
            raise ValueError("rollout.tools and rollout.environment are both set: tools answer "
                             "the calls inside the policy's replies, an environment answers "
                             "every reply; give one of them (an environment may call your "
                             "tools itself)")
        if self.overlap_tools and self.environment is not None:
            raise ValueError("rollout.overlap_tools=true with rollout.environment: an "
                             "environment answers every reply in this process, in order, so "
                             "there are no tool waits to overlap; set overlap_tools=false")
        if self.overlap_tools and not self.tool_specs:
            raise ValueError("rollout.overlap_tools=true overlaps the calls of rollout.tools, "
                             "which is empty; set rollout.tools or drop overlap_tools")
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns={self.max_turns} must be >= 1")
        budget = self.max_episode_tokens
        if budget != EPISODE_TOKENS_AUTO and (not isinstance(budget, int)
                                              or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"rollout.max_episode_tokens={budget!r} must be "
                             f"{EPISODE_TOKENS_AUTO!r} or a token count")
        bounds = [f"rollout.max_turns={self.max_turns}"] if self.max_turns != 1 else []
        if budget not in (EPISODE_TOKENS_AUTO, 0):
            bounds.append(f"rollout.max_episode_tokens={budget}")
        if not self.multi_turn and bounds:
            raise ValueError(f"{' and '.join(bounds)} bound episodes with tools or an "
                             "environment; set rollout.tools or rollout.environment, or drop "
                             "them")
        if self.multi_turn and budget == 0:
            raise ValueError(f"rollout.max_episode_tokens={budget}: with rollout.tools or "
                             "rollout.environment give the tokens an episode may take after "
                             f"its prompt (replies and answers), or {EPISODE_TOKENS_AUTO!r}")
        if self.tool_on_error not in TOOL_ON_ERROR:
            raise ValueError(f"rollout.tool_on_error={self.tool_on_error!r}: use one of "
                             f"{TOOL_ON_ERROR}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.tool_timeout_s={self.tool_timeout_s} must be > 0")
        if self.tool_workers < 1:
            raise ValueError(f"rollout.tool_workers={self.tool_workers} must be >= 1")

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The tokens an episode may take after its prompt: ``max_episode_tokens``, or for
        ``auto`` every reply of ``max_new_tokens`` and an answer of ``max_prompt_length``
        between two replies."""
        if self.max_episode_tokens != EPISODE_TOKENS_AUTO:
            return self.max_episode_tokens
        return self.max_turns * max_new_tokens + (self.max_turns - 1) * self.max_prompt_length

    @property
    def tool_specs(self) -> list[ToolSpec]:
        """The checked ``tools`` (empty: none)."""
        return parse_tools(self.tools)

    @property
    def environment_spec(self) -> EnvironmentSpec | None:
        """The checked ``environment``, or None."""
        return None if self.environment is None else parse_environment(self.environment)

    @property
    def multi_turn(self) -> bool:
        """Whether a rollout is an episode (``tools`` or ``environment``)."""
        return bool(self.tools) or self.environment is not None

    @property
    def rows_per_step(self) -> int:
        """Rows of a step's experience batch: every prompt's ``samples_per_prompt`` responses."""
        return self.prompts_per_step * self.samples_per_prompt


@dataclass
class RewardConfig:
    """How a response is scored: ``model_weight * rm + rule_weight * rule + sum_f weight_f * f``.

    Attributes:
        model_weight: weight of the reward model's score. 0: no reward model is placed or run
            (the score is the rule's, the functions' and an environment's), and
            ``models.reward_checkpoint`` must be empty; with no rule, function or environment
            either, the run is refused; > 0 without a checkpoint scores with a freshly initialised reward model.
        rule: a rule-based reward added to it: ``synthetic`` (the shipped task's rule, on decoded
            text) or ``none``.
        rule_weight: weight of the rule's score.
        functions: reward functions, each ``{name: "package.module:function", weight: 1.0,
            ...keyword arguments}`` (or a registered name such as ``math_reward`` as ``name``:
            ``rewards.REWARD_FUNCTIONS``), called as ``function(prompt, response, record,
            **kwargs)`` with the prompt's whole data record (docs/rewards.md); checked (imports,
            callable, keyword arguments, finite weight) when the config is built.
        on_error: a function that raises, runs past ``timeout_s`` or returns no finite number:
            ``error`` (stop, naming the function and the record) or ``zero`` (score 0, counted
            in ``reward/errors``).
        timeout_s: the longest one call of a reward function may run, seconds.
        workers: worker processes per scoring rank that call the reward functions.
        overlong_buffer: DAPO's overlong penalty, by generated tokens: 0 off; else a response
            longer than ``generation.max_new_tokens - overlong_buffer`` tokens loses score
            linearly, up to ``overlong_penalty`` at ``max_new_tokens`` (``rewards/overlong.py``).
        overlong_penalty: the largest penalty (> 0).
    """

    model_weight: float = 1.0
    rule: str = "none"
    rule_weight: float = 1.0
    functions: list[dict[str, Any]] = field(default_factory=list)
    on_error: str = "error"
    timeout_s: float = 10.0
    workers: int = 2
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.rule not in ("none", "synthetic"):
            raise ValueError(f"reward.rule={self.rule!r}: use 'synthetic' or 'none'")
        self.specs  # noqa: B018 (imports and checks the functions, once: refused at the edge)
        if self.on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"reward.on_error={self.on_error!r}: use one of {ON_ERROR_POLICIES}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if self.workers < 1:
            raise ValueError(f"reward.workers={self.workers} must be >= 1")
        if self.overlong_buffer < 0:
            raise ValueError(f"reward.overlong_buffer={self.overlong_buffer} must be >= 0 (0 turns "
                             "the overlong penalty off)")
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty > 0):
            raise ValueError(f"reward.overlong_penalty={self.overlong_penalty} must be a finite "
                             "number > 0; e.g. 1.0")

    @cached_property
    def specs(self) -> list[RewardFunctionSpec]:
        """``functions``, checked: parsed (their modules imported) once, when the config is
        built; every later read returns that list, so the step loop imports nothing."""
        return parse_reward_functions(self.functions)

    def overlong(self, max_new_tokens: int) -> OverlongPenalty | None:
        """The overlong penalty of responses of at most ``max_new_tokens``, or None when off."""
        if not self.overlong_buffer:
            return None
        return OverlongPenalty(max_new_tokens, self.overlong_buffer, self.overlong_penalty)


@dataclass
class ClusterConfig:
    """The devices; empty ``pools`` means one pool shaped like torchrun's world.

    Attributes:
        pools: device pools in rank order (several for heterogeneous separation).
    """

    pools: list[DevicePool] = field(default_factory=list)


@dataclass
class PromptSplitConfig(SplitConfig):
    """The SFT/RM/PPO split of PPO's prompt files: PPO's all of them unless a config of the
    InstructGPT chain splits them."""

    sft: float = 0.0
    """Fraction for supervised fine-tuning (not read by PPO)."""
    rm: float = 0.0
    """Fraction for reward-model training (not read by PPO)."""
    ppo: float = 1.0
    """Fraction for PPO rollouts."""


@dataclass
class PromptReaderConfig(ReaderConfig):
    """``prompts.reader``: a :class:`ReaderConfig` whose errors name ``prompts.reader``."""

    WHERE: ClassVar[str] = "prompts.reader"


@dataclass
class PromptsConfig:
    """Where the PPO prompts come from.

    Attributes:
        paths: JSONL/Parquet preference files; empty means the shipped synthetic task.
        reader: field names and bad-record policy for ``paths`` (and ``evaluation.paths``); PPO
            needs only the prompt, so only ``prompt`` is required by default.
        split: SFT/RM/PPO fractions of ``paths``; PPO uses the ``ppo`` portion. By default all
            of it: the InstructGPT chain's split is set by its own configs
            (``examples/ppo_pipeline.yaml``), so that its stages see different prompts.
        synthetic: size and seed of the synthetic task when ``paths`` is empty.
        chat_template: wrap each plain-text prompt as one user turn in the tokenizer's chat
            template when it has one (Hugging Face tokenizers); conversation records
            (``messages``) always go through the template.
    """

    paths: list[str] = field(default_factory=list)
    reader: PromptReaderConfig = field(
        default_factory=lambda: PromptReaderConfig(required=["prompt"]))
    split: PromptSplitConfig = field(default_factory=PromptSplitConfig)
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    chat_template: bool = True


@dataclass
class PTXConfig:
    """InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2): a supervised loss on demonstrations
    added to the actor's PPO loss at every optimizer step, so that RL does not unlearn what the
    demonstrations taught (the "alignment tax").

    Attributes:
        coef: gamma, the weight of the supervised rows' mean response-token negative
            log-likelihood in the actor's loss; 0 turns PPO-ptx off.
        rows: supervised rows per actor update (the whole model's; its DP replicas split them as
            they split the PPO mini-batch); 0: as many as the PPO mini-batch has.
        paths: JSONL/Parquet files of (prompt, response) records, read with ``prompts.reader``
            and used whole. Empty: the ``sft`` portion of ``prompts.paths`` (the demonstrations
            SFT learned from), or the synthetic task's reference responses when
            ``prompts.paths`` is empty too.
    """

    coef: float = 0.0
    rows: int = 0
    paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"ptx.coef={self.coef} must be >= 0 (0 turns PPO-ptx off)")
        if self.rows < 0:
            raise ValueError(f"ptx.rows={self.rows} must be >= 0 (0: the PPO mini-batch's rows)")
        if not self.enabled and (self.rows or self.paths):
            given = "ptx.rows" if self.rows else "ptx.paths"
            raise ValueError(f"{given} is used only by PPO-ptx, which ptx.coef=0 turns off; set "
                             f"ptx.coef > 0 (e.g. ptx.coef=0.5), or drop {given}")

    @property
    def enabled(self) -> bool:
        """Whether the actor trains on supervised rows too."""
        return self.coef > 0


RESUME_MODES = ("off", "latest", "auto")
"""``checkpoint.resume``: start fresh, continue from the latest checkpoint (which must exist), or
continue when one exists and start fresh otherwise."""
RESUME_PIECES = ("optimizer", "scheduler", "kl_controller", "data_position", "rng",
                 "experience")
"""What a checkpoint restores besides the weights; ``checkpoint.resume_skip`` may leave any out."""


@dataclass
class CheckpointConfig:
    """Resumable checkpoints of the whole run (docs/reliability.md).

    A fresh run (``resume=off``) refuses a ``save_dir`` that holds complete checkpoints: they are
    another run's, and its saves and their pruning would replace them.

    Attributes:
        save_dir: where checkpoints are written, one ``step_<k>`` directory each (``k`` steps
            done); empty: no checkpoints. With it, the run also saves after its last step and
            when stopped (SIGTERM, or Ctrl-C to the job).
        save_interval: also save after every this many steps (0: only at the end or on SIGTERM).
        keep_last: complete checkpoints kept (0: all); older ones are removed only after a newer
            one is complete.
        resume: ``off`` (a fresh run), ``latest`` (``--resume``: continue from the latest valid
            checkpoint in ``save_dir``, which must hold one) or ``auto`` (``--resume auto``:
            continue when ``save_dir`` holds a complete checkpoint, else start fresh; for jobs
            that are requeued or restarted by torchrun). ``true``/``false`` mean latest/off.
        resume_from: continue from this checkpoint directory instead (a ``step_<k>`` directory).
        async_save: write the model shards in a background thread while the next step runs (the
            step waits only for a host copy of its shards); the checkpoint is completed (manifest,
            rename) after that step, or at once after the last step and on SIGTERM. Megatron-FSDP
            shards are always written synchronously.
        resume_skip: pieces of the checkpoint a resume leaves out, besides the weights, which it
            always loads: ``optimizer`` (fresh Adam moments, as Megatron-LM's
            ``--no-load-optim``), ``scheduler`` (the learning-rate schedule starts over),
            ``kl_controller`` (the adaptive KL coefficient starts at its initial value),
            ``data_position`` (the run counts steps and draws prompts from 0: fine-tuning from
            the checkpoint's weights), ``rng`` (``--no-load-rng``), ``experience`` (the rollouts
            an asynchronous run had produced ahead are generated again). A resume without any of
            them no longer equals the uninterrupted run.
    """

    save_dir: str = ""
    save_interval: int = 0
    keep_last: int = 2
    resume: str = "off"
    resume_from: str = ""
    async_save: bool = True
    resume_skip: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # YAML's and the CLI's booleans (a str field receives them as "True"/"False").
        self.resume = {"true": "latest", "false": "off"}.get(str(self.resume).lower(),
                                                             str(self.resume))
        if self.resume not in RESUME_MODES:
            raise ValueError(f"checkpoint.resume={self.resume!r} is not one of {RESUME_MODES} "
                             "(--resume is latest, --resume auto is auto)")
        if self.save_interval < 0:
            raise ValueError(f"checkpoint.save_interval={self.save_interval} must be >= 0 "
                             "(0 saves only at the end and on SIGTERM)")
        if self.keep_last < 0:
            raise ValueError(f"checkpoint.keep_last={self.keep_last} must be >= 0 (0 keeps all)")
        if self.save_interval and not self.save_dir:
            raise ValueError(f"checkpoint.save_interval={self.save_interval} needs a "
                             "checkpoint.save_dir (--save-dir) to write to")
        if self.resume != "off" and not self.resume_from and not self.save_dir:
            raise ValueError(f"checkpoint.resume={self.resume} (--resume) looks for the latest "
                             "checkpoint in checkpoint.save_dir; set --save-dir, or name one "
                             "with checkpoint.resume_from=PATH")
        if self.resume_from and self.resume == "auto":
            raise ValueError("checkpoint.resume=auto and checkpoint.resume_from both choose "
                             "where to resume from; give one of them")
        if self.resume_skip and self.resume == "off" and not self.resume_from:
            raise ValueError(f"checkpoint.resume_skip={list(self.resume_skip)} applies to a "
                             "resume, and this run starts fresh; resume (--resume, or "
                             "checkpoint.resume_from=PATH) or drop checkpoint.resume_skip")
        unknown = sorted(set(self.resume_skip) - set(RESUME_PIECES))
        if unknown:
            raise ValueError(f"checkpoint.resume_skip has {unknown}, which are not pieces of a "
                             f"checkpoint; choose from {list(RESUME_PIECES)}")

@dataclass
class EvalConfig:
    """Held-out evaluation of the policy during a PPO run."""

    paths: list[str] = field(default_factory=list)
    """Held-out prompt files (JSONL/Parquet, read whole with ``prompts.reader``); empty: the test
    split of ``prompts.synthetic`` when the run uses the synthetic task, else no evaluation."""
    num_prompts: int = 0
    """Evaluate on the first this many held-out prompts (0: no evaluation; the pipeline's
    examples/ppo_pipeline.yaml sets 128)."""
    interval: int = 20
    """Evaluate before every ``interval``-th step, besides before the first and after the last
    step (0: only those two)."""
    log_examples: int = 2
    """Log the answers to this many held-out prompts at every evaluation (rank-aware logger)."""
    hacking_tolerance: float = 0.03
    """A held-out rule score this far below the first evaluation's, while the reward model's
    held-out score rose by more than ``hacking_rm_rise``, is reported as reward hacking."""
    hacking_rm_rise: float = 2.0
    """The rise of the mean held-out reward-model score that counts, in standard errors of that
    change (``sqrt((std_first**2 + std_now**2) / n)`` for ``n`` held-out answers: the reward
    model's scale is arbitrary)."""

    def __post_init__(self) -> None:
        if self.num_prompts < 0:
            raise ValueError(f"evaluation.num_prompts={self.num_prompts} must be >= 0 "
                             "(0 turns evaluation off)")
        if self.interval < 0:
            raise ValueError(f"evaluation.interval={self.interval} must be >= 0 (0: evaluate "
                             "only before the first and after the last step)")
        if self.log_examples < 0:
            raise ValueError(f"evaluation.log_examples={self.log_examples} must be >= 0")
        for name in ("hacking_tolerance", "hacking_rm_rise"):
            if getattr(self, name) < 0:
                raise ValueError(f"evaluation.{name}={getattr(self, name)} must be >= 0")
        if self.paths and not self.num_prompts:
            raise ValueError(f"evaluation.paths={list(self.paths)} is read only when "
                             "evaluation.num_prompts > 0, and it is 0 (evaluation off); set "
                             "evaluation.num_prompts (e.g. 64), or drop evaluation.paths")

    def due(self, step: int, start: int) -> bool:
        """Whether to evaluate before step ``step`` of a run (or resumption) starting at
        ``start``."""
        return step == start or bool(self.interval and step % self.interval == 0)


@contextmanager
def _naming_critic_free_estimators() -> Iterator[None]:
    """Adds the registered critic-free estimators to a placement's refusal of a critic option
    (``topology/`` sits below ``algorithms/`` and knows no estimator names)."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{error} (critic-free estimators: {critic_free_estimators()})") from None


def _in_section(settings: OptimizerSettings, section: type[OptimizerSettings]
                ) -> OptimizerSettings:
    """``settings`` as an instance of its role's ``section`` subclass (the same values)."""
    if isinstance(settings, section):
        return settings
    return section(**{f.name: getattr(settings, f.name) for f in fields(settings)})


@dataclass
class ActorOptimizerSettings(OptimizerSettings):
    """The actor's optimizer settings (``OptimizerSettings``); refusals name
    ``actor_optimizer``."""

    SECTION: ClassVar[str] = "actor_optimizer"


@dataclass
class CriticOptimizerSettings(OptimizerSettings):
    """The critic's optimizer settings (``OptimizerSettings``); refusals name
    ``critic_optimizer``."""

    SECTION: ClassVar[str] = "critic_optimizer"


@dataclass
class RunConfig:
    """Everything a PPO run needs; the tiny CPU default runs on 4 ranks.

    Attributes:
        runtime: seed, logging and distributed start-up.
        placement: which ranks each model runs on, and its parallel layout.
        models: which networks the four roles are, their precision and memory options.
        rollout: how many prompts and answers a step takes, and how they are trained on.
        generation: how answers are sampled.
        reward: what scores an answer: the reward model, a rule, Python functions.
        tokenizer: the tokenizer of every model (or a Hugging Face directory's).
        prompts: the prompt files (or the synthetic task) and how records are read and split.
        cluster: the device pools (one pool of the launched ranks by default).
        algorithm: the RL algorithm's estimator, losses and KL control.
        actor_optimizer: the actor's optimizer and learning-rate schedule.
        critic_optimizer: the critic's optimizer and learning-rate schedule.
        checkpoint: saving and resuming the whole run.
        evaluation: held-out evaluation of the policy during the run.
        ptx: PPO-ptx, the supervised loss on demonstrations mixed into the actor's updates.
        refit: how the weight sync into the shadows is checked.
        faults: what a rank failure, a hang or a NaN does.
        steps: PPO steps (0 only evaluates the initial policy).
        run_dir: where ``metrics.jsonl``, ``config.yaml``, ``plan.json`` and TensorBoard events
            are written.
    """

    INPUT_PATHS: ClassVar[tuple[str, ...]] = (
        "prompts.paths", "evaluation.paths", "ptx.paths", "models.actor_checkpoint",
        "models.reward_checkpoint", "models.lora.init_adapter_dir", "tokenizer.hf_dir",
        "tokenizer.model_path",
        "tokenizer.corpus_path", "checkpoint.resume_from")
    """What the run reads; relative values are relative to the YAML file that gives them
    (``config.loader``)."""
    OUTPUT_PATHS: ClassVar[tuple[str, ...]] = (
        "run_dir", "models.hf_cache_dir", "tokenizer.cache_dir")
    """Where the run writes (its outputs, its caches): never empty (``config.paths``)."""
    BOOLEAN_WORDS: ClassVar[dict[str, tuple[str, str]]] = {
        "generation.cuda_graphs": ("off", "on"), "checkpoint.resume": ("off", "latest"),
        "refit.verify": ("off", "every")}
    """The fields that take ``off``/``on``/``yes``/``no``, which YAML reads as booleans: the
    values false and true stand for (``config.loader``)."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)
    actor_optimizer: ActorOptimizerSettings = field(default_factory=ActorOptimizerSettings)
    critic_optimizer: CriticOptimizerSettings = field(default_factory=CriticOptimizerSettings)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    ptx: PTXConfig = field(default_factory=PTXConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    steps: int = 10
    run_dir: str = "runs/ppo"
    trace: bool = False
    """Record a per-rank timeline into ``<run_dir>/timeline.json`` (Chrome trace format)."""

    def __post_init__(self) -> None:
        """Fits the placement to the algorithm: a critic-free estimator places no critic, and
        ``reward.model_weight=0`` no reward model.

        Raises:
            ValueError: negative steps, no new tokens, an option that needs a critic (AC-Share,
                a critic ratio, interleaving2) with a critic-free estimator, critic-free ratios
                with gae, fewer than 2 samples per prompt for grpo or rloo, a reward checkpoint
                with ``reward.model_weight=0``, or an option Megatron-FSDP cannot serve.
        """
        # Settings built in Python as a plain OptimizerSettings take their role's section, so
        # refusals name it and the YAML written for the run loads back.
        self.actor_optimizer = _in_section(self.actor_optimizer, ActorOptimizerSettings)
        self.critic_optimizer = _in_section(self.critic_optimizer, CriticOptimizerSettings)
        check_paths(self, self.OUTPUT_PATHS,
                    (*self.INPUT_PATHS, "checkpoint.save_dir", "faults.stop_file"))
        if self.steps < 0:
            raise ValueError(f"steps={self.steps} must be >= 0 (0 only evaluates the initial "
                             "policy)")
        if self.generation.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens={self.generation.max_new_tokens} leaves "
                             "PPO no response to score; give at least 1")
        if self.rollout.multi_turn and self.rollout.max_episode_tokens == EPISODE_TOKENS_AUTO:
            self.rollout.max_episode_tokens = self.rollout.episode_tokens(
                self.generation.max_new_tokens)
        algorithm, placement = self.algorithm, self.placement
        if algorithm.uses_critic and not placement.critic:
            raise ValueError(
                f"placement.critic=false but algorithm.advantage_estimator="
                f"{algorithm.advantage_estimator!r} trains a critic: choose one of "
                f"{critic_free_estimators()}, or leave placement.critic alone (it follows the "
                "estimator)")
        if not algorithm.uses_critic and placement.critic:
            with _naming_critic_free_estimators():
                self.placement = replace(placement, critic=False)
        self._fit_reward_model()
        self._fit_reference_model()
        self._check_reward_source()
        self._check_partial_rollouts()
        with _naming_critic_free_estimators():
            self.placement.role_ratios()
        self._check_fsdp()
        self._check_lora()
        self._check_optimizer_sharding()
        self._check_router_replay()
        self._check_cuda_graphs()
        self.models.moe.check_expert_parallel(
            {role: o.ep for role, o in self.placement.parallel.items() if o.ep},
            tuple(role for role in TRAINABLE_ROLES if self.optimizer(role).fsdp),
            multi_turn=bool(self.rollout.tools or self.rollout.environment)
            and self.rollout.max_turns > 1)
        if self.reward.overlong_buffer > self.generation.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} exceeds "
                f"generation.max_new_tokens={self.generation.max_new_tokens}, the length it "
                "counts back from; lower it (DAPO: a quarter of max_new_tokens)")
        if (self.rollout.max_tokens_per_micro_batch not in (0, TOKEN_BUDGET_AUTO)
                and not self.models.packed_sequences):
            raise ValueError("rollout.max_tokens_per_micro_batch groups rows of any count, which "
                             "only packed sequences run in one shape: set "
                             "models.packed_sequences=true or max_tokens_per_micro_batch=0")
        n = self.rollout.samples_per_prompt
        if algorithm.needs_groups and n < 2:
            raise ValueError(
                f"rollout.samples_per_prompt({n}) must be >= 2 for algorithm.advantage_estimator="
                f"{algorithm.advantage_estimator!r}: the baseline of a response is the other "
                "responses to its prompt; e.g. rollout.samples_per_prompt=4")

    def _fit_reward_model(self) -> None:
        """Place a reward model exactly when its score is used (``reward.model_weight`` != 0)."""
        weight, checkpoint = self.reward.model_weight, self.models.reward_checkpoint
        if weight == 0 and checkpoint:
            raise ValueError(
                f"models.reward_checkpoint={checkpoint} is given but reward.model_weight=0 "
                "runs no reward model: set reward.model_weight > 0 to score with it, or drop "
                "models.reward_checkpoint")
        if weight != 0 and not self.placement.reward:
            raise ValueError(
                f"placement.reward=false but reward.model_weight={weight} scores with a reward "
                "model: set reward.model_weight=0, or leave placement.reward alone (it follows "
                "reward.model_weight)")
        if weight == 0 and self.placement.reward:
            self.placement = replace(self.placement, reward=False)

    def _fit_reference_model(self) -> None:
        """Place no reference model when the actor's base gives the reference log-probs (LoRA
        on the actor: its adapters switched off)."""
        base_is_reference = self.models.lora.applies_to(ACTOR)
        if not base_is_reference and not self.placement.reference:
            raise ValueError(
                "placement.reference=false places no reference model, which only LoRA on the "
                "actor can spare (its base is then the reference): set models.lora.rank > 0, or "
                "leave placement.reference alone (it follows models.lora)")
        if base_is_reference and self.placement.reference:
            self.placement = replace(self.placement, reference=False)

    def _check_partial_rollouts(self) -> None:
        """What partial rollouts need beyond the rollout section (``RolloutConfig``)."""
        if not self.rollout.partial_rollouts:
            return
        if self.algorithm.dynamic_sampling:
            raise ValueError("rollout.partial_rollouts=true cannot refill a step with "
                             "algorithm.dynamic_sampling: a refill round would sample under "
                             "the new weights; set one of them to false")
        if self.models.offload.get("actor", "never") != "never":
            raise ValueError(f"rollout.partial_rollouts=true needs the shadow actor's weights on "
                             f"its device through generation, where the new ones arrive; "
                             f"models.offload.actor={self.models.offload['actor']!r} may move "
                             "them out: set it to never, or partial_rollouts=false")
        if not self.generation.continuous:
            raise ValueError("rollout.partial_rollouts=true needs continuous batching "
                             "(generation.batching=continuous, generation.use_kv_cache=true): "
                             "the weights change between its decode steps")
        if not self.rollout.continue_answers:
            return
        if self.reward.functions:
            raise ValueError("rollout.continue_answers=true cannot score with reward.functions: "
                             "which prompts a step's answers answer is known only on the "
                             "generating ranks, not to the scorer that reads their records; "
                             "drop the functions or set continue_answers=false")
        if self.placement.replan.move:
            raise ValueError("rollout.continue_answers=true cannot move to another placement "
                             "(placement.replan.move=true): the answers in flight live in the "
                             "shadows' decoding slots; set one of them to false")

    def _check_reward_source(self) -> None:
        """Refuse a run that nothing scores: no reward model, no rule, no reward function and
        no environment (whose step rewards are a score of their own)."""
        reward = self.reward
        if (reward.model_weight == 0 and reward.rule == "none" and not reward.functions
                and self.rollout.environment is None):
            raise ValueError("reward.model_weight=0 with reward.rule='none' leaves no reward; "
                             "set a rule, reward.functions, rollout.environment or a non-zero "
                             "model_weight")

    @property
    def ptx_rows(self) -> int:
        """Supervised rows per actor update (``ptx.rows``, or the PPO mini-batch's rows)."""
        return self.ptx.rows or self.rollout.rows_per_step // self.rollout.num_minibatches

    def optimizer(self, role: str) -> OptimizerSettings:
        """The optimizer settings of a trained role (``<role>_optimizer``)."""
        if role not in TRAINABLE_ROLES:
            raise ValueError(f"{role!r} is not trained: no optimizer settings "
                             f"(trained roles: {TRAINABLE_ROLES})")
        return self.actor_optimizer if role == ACTOR else self.critic_optimizer

    def check_machine(self) -> None:
        """Refuse settings this machine cannot run (``OptimizerSettings.check_machine``); not
        at load, so that ``--plan-only`` prices a job for other machines."""
        for role in TRAINABLE_ROLES:
            self.optimizer(role).check_machine()

    def _check_cuda_graphs(self) -> None:
        """Refuse ``generation.cuda_graphs=on`` for a mixture of experts: megatron's token
        dispatch synchronises with the host, so its decode step cannot be captured (``auto``
        decodes it eagerly)."""
        if self.generation.cuda_graphs == "on" and self.models.moe.enabled:
            raise ValueError("generation.cuda_graphs=on cannot capture an MoE model's decode step "
                             f"(models.moe.num_experts={self.models.moe.num_experts}): megatron's "
                             "token dispatch synchronises with the host; set "
                             "generation.cuda_graphs=auto (decodes it eagerly) or off")

    def _check_router_replay(self) -> None:
        """Refuse MoE routing replay where the policy's routes cannot be kept by row: a
        pipeline-parallel policy, sequence parallelism under TP, full recomputation."""
        moe, models, placement = self.models.moe, self.models, self.placement
        if not moe.enabled or not moe.router_replay:
            return
        fix = "or set models.moe.router_replay=false"
        if models.recompute.get(ACTOR) == "full":
            raise ValueError("models.recompute.actor=full reruns the routers in the backward "
                             f"pass, outside the replayed routing: use selective or none, {fix}")
        for role in (ACTOR, SHADOW_ACTOR):
            parallel = placement.role_parallel(role)
            tp, pp = parallel.tp, parallel.pp
            if pp > 1:
                raise ValueError(f"{role} pp={pp}: routing replay keeps one pipeline stage's "
                                 f"routes; place the policy with pp=1, {fix}")
            if tp > 1 and models.sequence_parallel and models.packed_sequences:
                raise ValueError(f"{role} tp={tp} with models.sequence_parallel=true: each TP "
                                 "rank routes its own chunk of the sequence; set "
                                 f"models.sequence_parallel=false, {fix}")

    def _check_optimizer_sharding(self) -> None:
        """Refuse a placement whose memory plan shards a trained model's optimizer state
        differently from the optimizer the engine builds (``<role>_optimizer``)."""
        roles = TRAINABLE_ROLES if self.placement.places_critic else (ACTOR,)
        for role in roles:
            override = self.placement.parallel.get(role)
            if override is not None and override.distributed_optimizer is not None:
                planned, field_ = override.distributed_optimizer, (
                    f"placement.parallel.{role}.distributed_optimizer")
            else:
                planned, field_ = (self.placement.distributed_optimizer,
                                   "placement.distributed_optimizer")
            built = self.optimizer(role).distributed_optimizer
            if planned != built:
                raise ValueError(
                    f"{field_}={str(planned).lower()} but {role}_optimizer.distributed_optimizer="
                    f"{str(built).lower()}: the {role}'s optimizer is built from the second and "
                    "its memory is planned from the first; give both the same value")

    def _check_lora(self) -> None:
        """Refuse what adapters (``models.lora``) are not yet carried through: Megatron-FSDP,
        AC-Share, a critic that is not there; a PEFT starting point that does not fit."""
        lora = self.models.lora
        if not lora.enabled:
            return
        if lora.init_adapter_dir:
            lora.check_adapter_dir("models.lora")
        if CRITIC in lora.roles and not self.placement.critic:
            raise ValueError(f"models.lora.roles={lora.roles} names the critic, but this run "
                             "has no critic (a critic-free estimator): drop it from the roles")
        if self.placement.ac_share:
            raise ValueError("models.lora with placement.ac_share=true: the shared trunk's "
                             "value head is not kept trainable; set placement.ac_share=false")
        for role in lora.roles:
            if self.optimizer(role).fsdp:
                raise ValueError(f"{role}_optimizer.fsdp=true with models.lora on the {role}: "
                                 "Megatron-FSDP is not checked with frozen weights; set "
                                 f"{role}_optimizer.fsdp=false (the adapters are small)")

    def _check_fsdp(self) -> None:
        """Refuse what reads or moves a Megatron-FSDP model's whole parameters, which it holds
        only while its wrapper computes (``make_plan`` checks its layout). Run checkpoints save
        its shards (``models.fsdp_checkpoint``) and Hugging Face export gathers them."""
        for role in TRAINABLE_ROLES:
            if not self.optimizer(role).fsdp:
                continue
            field_ = f"{role}_optimizer.fsdp=true"
            if self.placement.separated:
                raise ValueError(f"{field_}: placement.strategy={self.placement.strategy!r} "
                                 f"copies the {role}'s whole weights into a shadow after each "
                                 "step, which Megatron-FSDP does not hold; use flattening")
            if self.models.offload_policy(role) != "never":
                raise ValueError(f"{field_}: models.offload.{role}="
                                 f"{self.models.offload_policy(role)!r} moves the model's "
                                 "storages to the host, which Megatron-FSDP allocates and frees "
                                 f"itself; set models.offload.{role}=never")
