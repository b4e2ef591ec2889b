"""What both trainers (PPO's engine and the supervised loop) build models from.

- ``sources.py``: initial checkpoints (megatron_rlhf or Hugging Face) of each role, their
  architectures and build options, and loading them into built models.
- ``networks.py``: a role's model built on its process groups and initialised.
"""
