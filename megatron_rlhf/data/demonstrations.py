"""The supervised rows of each actor update (PPO-ptx), as a pure function of the update number.

Like :class:`~megatron_rlhf.data.prompts.PromptStream`, every rank builds the same stream and
asks it for update ``u``'s rows, so nothing is broadcast and a resumed run needs only ``u``. The
demonstrations are tokenised once (so a prompt too long for the rows is refused before the run
starts) and an update's rows are right-padded to the length of PPO's sequences, the shape one
call of megatron's schedule needs; each pass over them is a fresh seeded permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rlhf.data.collate import right_pad_sft, sft_sequences
from megatron_rlhf.data.datasets import SFTExample
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.tokenizer import Tokenizer


class DemonstrationStream:
    """Rows of ``input_ids``, ``attention_mask`` and ``loss_mask`` ``[rows, length]`` per update.

    Args:
        examples: the (prompt, response) demonstrations; a response may be tool-calling turns,
            whose tool answers are left out of the loss.
        tokenizer: the run's tokenizer.
        length: tokens per row (PPO's ``max_prompt_length + max_new_tokens``); longer
            demonstrations lose the end of their response.
        rows: rows per update.
        seed: seed of the per-pass permutations.
        use_chat_template: as in :func:`~megatron_rlhf.data.collate.collate_sft`.

    Raises:
        ValueError: fewer demonstrations than ``rows``, or a prompt that fills ``length``.
    """

    def __init__(self, examples: Sequence[SFTExample], tokenizer: Tokenizer | HFTokenizer,
                 length: int, rows: int, seed: int, use_chat_template: bool = True) -> None:
        if rows > len(examples):
            raise ValueError(f"ptx.rows({rows}) exceeds the {len(examples)} demonstrations "
                             "available; lower ptx.rows or add records to ptx.paths")
        self.sequences = sft_sequences(examples, tokenizer, length, use_chat_template)
        self.pad_id = tokenizer.pad_id
        self.length = length
        self.rows = rows
        self.seed = seed
        self.updates_per_pass = len(examples) // rows
        self._order: tuple[int, torch.Tensor] | None = None

    def batch(self, update: int) -> dict[str, torch.Tensor]:
        """The rows of actor update ``update`` (counted over the whole run from 0)."""
        pass_index, position = divmod(update, self.updates_per_pass)
        chosen = self._pass_order(pass_index)[position * self.rows:(position + 1) * self.rows]
        batch = right_pad_sft([self.sequences[i] for i in chosen.tolist()], self.pad_id,
                              self.length)
        return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                "loss_mask": batch.loss_mask}

    def _pass_order(self, pass_index: int) -> torch.Tensor:
        """The permutation of pass ``pass_index``, drawn once per pass rather than per update
        (an update would otherwise shuffle the whole demonstration set to take ``rows`` of it)."""
        if self._order is None or self._order[0] != pass_index:
            self._order = (pass_index, torch.randperm(
                len(self.sequences), generator=torch.Generator().manual_seed(
                    self.seed + pass_index)))
        return self._order[1]
