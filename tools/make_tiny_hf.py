"""Make tiny Hugging Face checkpoints with ``transformers`` and ``tokenizers`` (no download): a
Qwen2.5-style policy (``Qwen2ForCausalLM``) and reward model (``Qwen2ForSequenceClassification``)
sharing a byte-level BPE tokenizer trained on a few sentences, with Qwen's special tokens and chat
template, and a JSONL file of conversation prompts. The tests build their models with the same
functions (Llama-3 style too).

    python tools/make_tiny_hf.py --out hf-tiny
    torchrun --nproc-per-node 2 tools/run_ppo.py --config examples/ppo_hf_tiny.yaml --tp 2
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a short poem about the sea, please.",
    "Numbers like 1234 and 56.78 appear too; so do emojis and accents: cafe, naive.",
    "  Leading spaces, tabs\tand\nnew lines matter.",
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}\n")

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# style -> (special tokens in id order, bos, eos, pad, extra end-of-reply tokens, template)
STYLES = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", None, ["<|end_of_text|>"], LLAMA3_TEMPLATE),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             None, "<|im_end|>", "<|endoftext|>", ["<|endoftext|>"], QWEN_TEMPLATE),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Write a poem about the sea."},
     {"role": "assistant", "content": " The sea is blue. "},
     {"role": "user", "content": "Another, please!"}],
]


def make_hf_tokenizer(directory: Path, style: str, vocab_size: int = 300) -> None:
    """Train and save a tokenizer of ``style`` (see STYLES) the way a hub checkpoint ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, pad, extra_eos, template = STYLES[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES * 4, trainer)
    if bos is not None:  # Llama-3 adds BOS in the post-processor
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                   pad_token=pad)
    fast.chat_template = template
    fast.save_pretrained(directory)
    eos_ids = [tokenizer.token_to_id(t) for t in [eos, *extra_eos]]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def make_hf_model(directory: Path, config_cls: str, model_cls: str, seed: int,
                  **config_fields) -> torch.nn.Module:
    """Save a random tiny model (norms and biases perturbed so that they count) and return it."""
    import transformers

    config = getattr(transformers, config_cls)(**config_fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # ones/zeros by default
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


TINY_QWEN = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
             "tie_word_embeddings": True}
"""A 2-layer GQA Qwen2 with tied embeddings, 128 positions."""


def make_tiny_qwen_pair(out: Path) -> tuple[Path, Path, Path]:
    """``out/qwen-policy``, ``out/qwen-rm`` (same tokenizer) and ``out/prompts.jsonl``."""
    actor, reward, tokenizer = out / "qwen-policy", out / "qwen-rm", out / "tokenizer"
    make_hf_tokenizer(tokenizer, "qwen")
    ids = json.loads((tokenizer / "generation_config.json").read_text())["eos_token_id"]
    for directory, model_cls in ((actor, "Qwen2ForCausalLM"),
                                 (reward, "Qwen2ForSequenceClassification")):
        make_hf_model(directory, "Qwen2Config", model_cls, seed=len(model_cls), **TINY_QWEN,
                      num_labels=1, eos_token_id=ids[0], pad_token_id=ids[1])
        for file in tokenizer.iterdir():  # the hub ships the same tokenizer with both models
            shutil.copyfile(file, directory / file.name)
    shutil.rmtree(tokenizer)
    prompts = out / "prompts.jsonl"
    turns = [[{"role": "user", "content": f"Write a short poem about the sea, number {i}."}]
             for i in range(8)]
    prompts.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))
    return actor, reward, prompts


def package_version() -> str:
    """The package's version, read from its source beside this tool (which runs without the
    package installed, as setup.py reads it)."""
    source = (Path(__file__).resolve().parents[1] / "megatron_rlhf" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', source, re.MULTILINE).group(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: ``--out`` and ``--version``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("hf-tiny"), help="directory to fill")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return parser.parse_args(argv)


if __name__ == "__main__":
    for path in make_tiny_qwen_pair(parse_args().out):
        print(f"wrote {path}")
