"""Supervised training of one model over every rank: SFT and the reward model.

- ``loop.py``: the shared loop (data, layout, steps, evaluation, checkpoint) over an ``Objective``.
- ``sft.py``: the SFT objective (response-token NLL) and ``run_sft``.
- ``reward_model.py``: the pairwise reward-model objective and ``run_reward_training``.
"""
