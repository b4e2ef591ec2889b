"""TRL's PPO and this project's PPO step on the same model shape and batch, one process on CPU.

    python benchmarks/trl_ppo.py --trl-python /tmp/trlvenv/bin/python

TRL is not a dependency: its side runs in the interpreter ``--trl-python`` names (a venv with
``trl`` and its ``PPOTrainer``, e.g. trl 0.24), as ``python benchmarks/trl_ppo.py --trl-side``.
Both sides train a Llama-style policy and critic of ``tiny``'s shape (2 layers, hidden 64, 4
heads, FFN 256, vocabulary 512), fp32, on ``--prompts`` prompts (TRL's ``--prompt-length``
tokens each; ours the shipped task's, at most that long), one sample each, ``--response-length`` new tokens with no early stop, one PPO epoch and one
mini-batch, for ``--steps`` steps. TRL's models are random (its trainer needs a reward model too;
ours scores with the shipped rule, no reward model). Each side's samples/s is the median of its
own per-step figure over the steps after the first: TRL's logged ``eps`` (episodes per second),
our run's ``samples_per_s``. One JSON line per side, then one with the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4}
"""``models.arch: tiny`` in Hugging Face Llama terms."""


def trl_side(args: argparse.Namespace) -> dict:
    """TRL's ``PPOTrainer`` for ``args.steps`` steps; the median of its per-step ``eps``."""
    import torch
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from trl import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    vocab = SHAPE["vocab_size"]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1",
                                        unk_token="t0")
    config = dict(SHAPE, pad_token_id=0, eos_token_id=1)
    policy, ref = LlamaForCausalLM(LlamaConfig(**config)), LlamaForCausalLM(LlamaConfig(**config))
    value, reward = (LlamaForSequenceClassification(LlamaConfig(num_labels=1, **config))
                     for _ in range(2))
    prompts = [[2 + (i * 7 + j) % (vocab - 2) for j in range(args.prompt_length)]
               for i in range(args.prompts)]
    episodes: list[float] = []

    class Record(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_kwargs):
            if logs and "eps" in logs:
                episodes.append(float(logs["eps"]))

    ppo = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.prompts,
                    gradient_accumulation_steps=1, num_ppo_epochs=1, num_mini_batches=1,
                    response_length=args.response_length, stop_token_id=None,
                    total_episodes=args.prompts * args.steps, missing_eos_penalty=None,
                    local_rollout_forward_batch_size=args.prompts, report_to=[], use_cpu=True,
                    bf16=False, fp16=False, save_strategy="no", num_sample_generations=0,
                    logging_steps=1)
    trainer = PPOTrainer(args=ppo, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value, callbacks=[Record()],
                         train_dataset=Dataset.from_dict({"input_ids": prompts}))
    trainer.train()
    return {"side": "trl", "trl": trl.__version__, "torch": torch.__version__,
            "steps": len(episodes), "samples_per_s": statistics.median(episodes[1:])}


def our_side(args: argparse.Namespace) -> dict:
    """``tools/run_ppo.py`` on one rank; the median ``samples_per_s`` of the steps after the
    first."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "1", str(REPO / "tools" / "run_ppo.py"),
                   "--config", str(REPO / "examples" / "ppo_tiny.yaml"),
                   "--steps", str(args.steps), f"run_dir={run_dir}",
                   "models.params_dtype=float32", "generation.stop_at_eos=false",
                   f"rollout.prompts_per_step={args.prompts}",
                   f"rollout.max_prompt_length={args.prompt_length}",
                   f"generation.max_new_tokens={args.response_length}",
                   "rollout.ppo_epochs=1", "rollout.num_minibatches=1"]
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    rates = [float(x) for x in re.findall(r"samples_per_s=([0-9.]+)", out.stdout + out.stderr)]
    return {"side": "megatron_rlhf", "steps": len(rates),
            "samples_per_s": statistics.median(rates[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="an interpreter with trl installed")
    parser.add_argument("--trl-side", action="store_true", help="run TRL's side here")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    batch = {"prompts": args.prompts, "prompt_length": args.prompt_length,
             "response_length": args.response_length}
    if args.trl_side:
        print(json.dumps({**trl_side(args), **batch}))
        return
    if not args.trl_python:
        parser.error("--trl-python is needed: an interpreter with trl installed")
    flags = [f"--prompts={args.prompts}", f"--prompt-length={args.prompt_length}",
             f"--response-length={args.response_length}", f"--steps={args.steps}"]
    trl_out = subprocess.run([args.trl_python, __file__, "--trl-side", *flags], cwd=REPO,
                             capture_output=True, text=True, check=True)
    trl = json.loads(trl_out.stdout.strip().splitlines()[-1])
    ours = {**our_side(args), **batch}
    print(json.dumps(trl))
    print(json.dumps(ours))
    print(json.dumps({"ratio_ours_over_trl": round(ours["samples_per_s"] / trl["samples_per_s"],
                                                   2)}))


if __name__ == "__main__":
    main()
