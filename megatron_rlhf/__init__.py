"""megatron_rlhf: distributed RLHF (PPO) on Megatron-Core with adaptive model placement."""

import warnings

# megatron-core announces at import time every optional GPU extra it did not find (Transformer
# Engine, Apex, ...). On CPU that is expected and says nothing about a run; the extras are checked
# where they are actually needed.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex|transformer_engine).*")
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.core.*")
warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*is deprecated.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
# megatron's distributed optimizer still calls the deprecated all_gather_into_tensor alias.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*is deprecated.*",
                        category=FutureWarning)

__version__ = "0.1.0"
