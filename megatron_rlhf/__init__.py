"""megatron_rlhf: distributed RLHF (PPO) on Megatron-Core with adaptive model placement.

Importing the package (or any of its modules) changes nothing process-wide: the patches of torch
and megatron-core and the warning filters are made by ``runtime.bootstrap.initialize_runtime``
and listed in ``runtime.patches``.
"""

__version__ = "0.1.0"
