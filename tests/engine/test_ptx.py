"""PPO-ptx (``ptx``): supervised rows in every actor update, weighted so that the step's loss is
``ppo_loss + coef * mean_nll``.

The gradient test computes the actor's gradient twice on 2 DP ranks: through the engine (the
supervised rows shared out over the replicas, in micro-batches of one row, megatron's schedule
dividing by the PPO token count) and by plain autograd on the whole mini-batch, with the policy
loss and the NLL written out from ``log_softmax``. They agree only if the rows, the weight and
the normalisation are all right. The same step's critic gradient is checked the same way against
the clipped value loss written out, with the recorded values moved so that the clip bites.
"""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import PTXConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.multirank import run_on_ranks

COEF = 0.7
PROMPT_LENGTH, NEW_TOKENS = 8, 6


def test_ptx_config_refuses_negative_values() -> None:
    with pytest.raises(ValueError, match="ptx.coef=-1"):
        PTXConfig(coef=-1)
    with pytest.raises(ValueError, match="ptx.rows=-2"):
        PTXConfig(rows=-2)


def test_plan_refuses_ptx_rows_the_actor_cannot_split() -> None:
    config = RunConfig(placement=PlacementConfig(strategy="flattening"),
                       rollout=RolloutConfig(prompts_per_step=8, micro_batch_size=2),
                       ptx=PTXConfig(coef=1.0, rows=6))
    with pytest.raises(ValueError, match=r"ptx.rows to a multiple of 8"):
        make_plan(config, ClusterSpec.homogeneous(1, 4))
    make_plan(RunConfig(placement=config.placement, rollout=config.rollout,
                        ptx=PTXConfig(coef=1.0, rows=16)), ClusterSpec.homogeneous(1, 4))


class _FixedDemonstrations:
    """Four right-padded random demonstrations, the same for every update."""

    def __init__(self) -> None:
        import torch

        generator = torch.Generator().manual_seed(11)
        length = PROMPT_LENGTH + NEW_TOKENS
        ids = torch.randint(4, 500, (4, length), generator=generator)
        real = torch.tensor([length, length - 3, length - 5, length - 1])
        positions = torch.arange(length)
        attention = (positions < real[:, None]).long()
        loss = attention * (positions >= 5).long()
        self.fields = {"input_ids": ids * attention, "attention_mask": attention,
                       "loss_mask": loss}

    def batch(self, update: int) -> dict:
        return dict(self.fields)


def _engine_gradient(ac_share: bool = False):
    """Build a flattened engine on this job's ranks, produce one step's experience and return
    ``(engine, experience, gradient_of)``: ``gradient_of(coef)`` runs the actor's
    update of that experience with PPO-ptx weight ``coef`` and returns the reduced gradient of
    every actor parameter (and how many micro-batches the step had) instead of applying it."""
    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig
    from megatron_rlhf.engine.run.build import build_engine
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.models.forward_backward import run_microbatches
    from megatron_rlhf.models.trainer import OptimizerSettings
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment

    initialize_runtime()
    config = RunConfig(
        # Replicated: every replica then holds the whole reduced gradient, not its shard.
        placement=PlacementConfig(strategy="flattening", distributed_optimizer=False,
                                  ac_share=ac_share),
        actor_optimizer=OptimizerSettings(distributed_optimizer=False),
        critic_optimizer=OptimizerSettings(distributed_optimizer=False),
        models=ModelsConfig(arch="tiny", init_seed=9),
        rollout=RolloutConfig(prompts_per_step=4, max_prompt_length=PROMPT_LENGTH,
                              micro_batch_size=1, max_tokens_per_micro_batch=0),
        generation=GenerationConfig(max_new_tokens=NEW_TOKENS, seed=3),
        algorithm=PPOAlgorithmConfig(clip_ratio=0.2),
        ptx=PTXConfig(coef=COEF))
    engine = build_engine(config, make_plan(config, cluster_from_environment()), eos_id=3,
                          pad_id=0)
    prompts = [[5, 7, 9], [6, 8], [10, 11, 12, 13], [14]]
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda step: (prompts, list(range(4))), total_steps=1,
                             demonstrations=_FixedDemonstrations(), ptx_coef=COEF)
    experience = algorithm.produce(0)
    captured: dict[str, dict] = {}

    def gradients_only(role: str):
        """The model's reduced gradient instead of an update."""
        worker = engine.workers[role]
        trainer = worker.trainer

        def train_step(microbatches, loss_fn):
            trainer.module.train()
            trainer.module.zero_grad_buffer()
            run_microbatches(trainer.module, worker.pg_collection, microbatches, loss_fn,
                             forward_only=False)
            captured[role] = dict(microbatches=len(microbatches), grads=[
                param.main_grad.clone() for param in worker.model.parameters()])
            return {"metrics": [], "grad_norm": 0.0, "lr": 0.0}

        trainer.train_step = train_step

    for role in ("actor", "critic"):
        if role in engine.workers:
            gradients_only(role)

    def gradient_of(coef: float) -> dict:
        """The actor's gradient (the critic's, if any, is left in ``captured["critic"]``)."""
        algorithm.ptx_coef = coef
        algorithm.consume(experience)
        return {**captured["actor"], "critic": captured.get("critic")}

    return engine, experience, gradient_of


def _demonstration_nll(model, vocab: int):
    """The mean response NLL of :class:`_FixedDemonstrations` under ``model``, from
    ``log_softmax`` of its logits (an AC-Share output's value channel dropped)."""
    from megatron_rlhf.models.forward_backward import model_inputs

    demo = _FixedDemonstrations().fields
    output = model(*model_inputs(demo)).float()
    logits = (output[..., :-1] if model.head_kind == "lm+scalar" else output)[..., :vocab]
    logprobs = logits[:, :-1].log_softmax(-1).gather(-1, demo["input_ids"][:, 1:, None])[..., 0]
    mask = demo["loss_mask"][:, 1:].float()
    return -(logprobs * mask).sum() / mask.sum()


def _gradients_both_ways() -> dict:
    import torch

    from megatron_rlhf.models.forward_backward import model_inputs

    engine, experience, gradient_of = _engine_gradient()
    _moved_old_values(experience.batch.fields)
    captured = gradient_of(COEF)
    model = engine.workers["actor"].model
    fields = experience.batch.fields
    vocab = model.real_vocab_size
    params = list(model.parameters())
    logits = model(*model_inputs(fields)).float()[..., :vocab]
    response = fields["input_ids"][:, engine.prompt_length:]
    logprobs = logits[:, engine.prompt_length - 1:-1].log_softmax(-1).gather(
        -1, response[..., None])[..., 0]
    mask = fields["response_mask"].float()
    ratio = (logprobs - fields["old_logprobs"]).exp()
    advantages = fields["advantages"]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    policy_loss = -(surrogate * mask).sum() / mask.sum()
    nll = _demonstration_nll(model, vocab)
    reference = torch.autograd.grad(policy_loss + COEF * nll, params, retain_graph=True)
    scale = max(float(g.abs().max()) for g in reference)
    worst = max(float((got - want).abs().max())
                for got, want in zip(captured["grads"], reference, strict=True))
    nll_only = torch.autograd.grad(COEF * nll, params)
    return {"relative_error": worst / scale,
            "ptx_share": max(float(g.abs().max()) for g in nll_only) / scale,
            "microbatches": captured["microbatches"],
            **_critic_gradient_check(engine, fields, captured["critic"])}


def _critic_gradient_check(engine, fields: dict, captured: dict) -> dict:
    """The critic's gradient from the engine against autograd of the clipped value loss
    ``0.5 * mean over response tokens of max((V - R)^2, (V_old + clip(V - V_old) - R)^2)``, with
    ``V`` the value head at the position before each response token. The old values of the
    experience were moved (``_moved_old_values``) so that both branches of the clip are taken."""
    import torch

    from megatron_rlhf.models.forward_backward import model_inputs

    model = engine.workers["critic"].model
    params = list(model.parameters())
    output = model(*model_inputs(fields)).float()[..., 0]
    values = output[:, engine.prompt_length - 1:-1]
    mask = fields["response_mask"].bool()
    old, returns = fields["values"], fields["returns"]
    clip = 0.2
    clipped = old + (values - old).clamp(-clip, clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    loss = 0.5 * per_token[mask].mean()
    reference = [torch.zeros_like(p) if g is None else g
                 for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True),
                                 strict=True)]
    scale = max(float(g.abs().max()) for g in reference)
    worst = max(float((got - want).abs().max())
                for got, want in zip(captured["grads"], reference, strict=True))
    moved = (values.detach() - old).abs()[mask]
    return {"critic_relative_error": worst / scale,
            "critic_both_branches": bool((moved > clip).any() and (moved < clip).any())}


def _moved_old_values(fields: dict) -> None:
    """Shift the recorded values by up to +-0.4 (the same draw on every rank), so that the
    value clip (0.2) is active on some tokens and not on others."""
    import torch

    generator = torch.Generator().manual_seed(21)
    shift = (torch.rand(fields["values"].shape, generator=generator) - 0.5) * 0.8
    fields["values"] = fields["values"] + shift * fields["response_mask"]


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_ptx_gradient_is_the_policy_loss_plus_coef_times_the_mean_nll() -> None:
    results = run_on_ranks(_gradients_both_ways, world_size=2, timeout_s=300)
    for result in results:
        assert result["microbatches"] == 4, "2 PPO rows and 2 demonstrations per replica"
        assert result["ptx_share"] > 0.05, "the NLL term moves the gradient measurably"
        assert result["relative_error"] < 1e-4
        assert result["critic_both_branches"], "the value clip is taken and not taken"
        assert result["critic_relative_error"] < 1e-4


def test_demonstrations_are_the_sft_portion_or_the_named_files(tmp_path) -> None:
    from megatron_rlhf.config.ppo_run import PromptsConfig, PromptSplitConfig
    from megatron_rlhf.data import DataConfig, load_splits
    from megatron_rlhf.data.synthetic import SyntheticTaskConfig, write_task_jsonl
    from megatron_rlhf.engine.run.runner import load_demonstrations
    from megatron_rlhf.models.tokenizer import SHIPPED_CORPUS, Tokenizer

    tokenizer = Tokenizer.train(SHIPPED_CORPUS, 512, tmp_path / "spm.model")
    paths = write_task_jsonl(tmp_path / "task", SyntheticTaskConfig(num_train=300))
    with pytest.raises(ValueError, match=r"the sft portion of prompts.paths is empty "
                                         r"\(prompts.split.sft=0, the default"):
        load_demonstrations(RunConfig(prompts=PromptsConfig(paths=[str(paths["train"])]),
                                      ptx=PTXConfig(coef=1.0)), tokenizer)
    prompts = PromptsConfig(paths=[str(paths["train"])],
                            split=PromptSplitConfig(sft=0.4, rm=0.3, ppo=0.3))
    assert load_demonstrations(RunConfig(prompts=prompts), tokenizer) is None, "off by default"
    stream = load_demonstrations(RunConfig(prompts=prompts, ptx=PTXConfig(coef=1.0)), tokenizer)
    splits, _ = load_splits(DataConfig([str(paths["train"])], prompts.reader, prompts.split))
    config = RunConfig()
    length = config.rollout.max_prompt_length + config.generation.max_new_tokens
    assert len(stream.sequences) == len(splits.sft)
    assert stream.batch(0)["input_ids"].shape == (stream.rows, length)
    assert stream.rows == config.rollout.prompts_per_step

    prompts_only = tmp_path / "prompts.jsonl"
    prompts_only.write_text('{"prompt": "Write about the sea:"}\n')
    with pytest.raises(ValueError, match=r"ptx.paths=\[.*prompts.jsonl'\] holds no \(prompt, "
                                         r"response\) record"):
        load_demonstrations(RunConfig(prompts=prompts, ptx=PTXConfig(
            coef=1.0, paths=[str(prompts_only)])), tokenizer)


def test_demonstrations_with_turns_leave_the_tool_answers_out(tmp_path) -> None:
    """``ptx.paths`` records whose response is tool-calling turns: each row is the prompt, the
    replies, the plain-text tool message and EOS, with the loss on the replies and EOS only."""
    import json

    from megatron_rlhf.engine.run.runner import load_demonstrations
    from megatron_rlhf.models.tokenizer import SHIPPED_CORPUS, Tokenizer

    tokenizer = Tokenizer.train(SHIPPED_CORPUS, 512, tmp_path / "spm.model")
    config = RunConfig()
    records = [(f"Double {n}.", f'<tool_call>{{"a": {n}}}</tool_call>', str(2 * n),
                f"It is {2 * n}.") for n in range(config.rollout.prompts_per_step)]
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "turns": [
        {"role": "assistant", "content": call}, {"role": "tool", "content": answer},
        {"role": "assistant", "content": reply}]}) + "\n"
        for prompt, call, answer, reply in records))
    stream = load_demonstrations(RunConfig(ptx=PTXConfig(coef=1.0, paths=[str(path)])), tokenizer)
    length = config.rollout.max_prompt_length + config.generation.max_new_tokens
    for (ids, mask), (prompt, call, answer, reply) in zip(stream.sequences, records, strict=True):
        parts = [(tokenizer.encode(prompt, add_bos=True), 0), (tokenizer.encode(call), 1),
                 (tokenizer.encode(f"\n<tool_response>\n{answer}\n</tool_response>\n"), 0),
                 (tokenizer.encode(reply, add_eos=True), 1)]
        assert ids == [t for part, _ in parts for t in part][:length]
        assert mask == [loss for part, loss in parts for _ in part][:length]


def _ptx_share_of_the_gradient_with_ac_share() -> dict:
    import torch

    engine, _, gradient_of = _engine_gradient(ac_share=True)
    with_ptx = gradient_of(COEF)["grads"]
    without = gradient_of(0.0)["grads"]
    model = engine.workers["actor"].model
    params = list(model.parameters())
    reference = torch.autograd.grad(COEF * _demonstration_nll(model, model.real_vocab_size),
                                    params, allow_unused=True)
    reference = [torch.zeros_like(p) if g is None else g for p, g in zip(params, reference,
                                                                           strict=True)]
    scale = max(float(g.abs().max()) for g in reference)
    worst = max(float((a - b - want).abs().max())
                for a, b, want in zip(with_ptx, without, reference, strict=True))
    return {"head": model.head_kind, "relative_error": worst / scale}


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_ptx_adds_coef_times_the_nll_gradient_to_an_ac_share_actor() -> None:
    """With a value head on the actor (AC-Share) the NLL reads the logits only: the gradient
    with PPO-ptx minus the one without is ``coef`` times the demonstrations' NLL gradient."""
    for result in run_on_ranks(_ptx_share_of_the_gradient_with_ac_share, world_size=2,
                               timeout_s=300):
        assert result["head"] == "lm+scalar"
        assert result["relative_error"] < 1e-4
