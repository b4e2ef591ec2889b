# megatron_rlhf on an NGC PyTorch container (CUDA torch, Transformer Engine and Apex included).
# Build:  docker build -t megatron_rlhf .
# Check:  docker run --gpus all --ipc=host megatron_rlhf          # scripts/gpu_check.sh (~6 min)
# Train:  docker run --gpus all --ipc=host megatron_rlhf \
#           torchrun --nproc-per-node 8 tools/run_ppo.py --config examples/ppo_llama7b.yaml
# megatron-core 0.16.1 needs torch >= 2.6: 25.01 and older images ship a 2.6 pre-release, which
# pip does not count as 2.6. This image's torch is 2.8 with Transformer Engine 2.4.
FROM nvcr.io/nvidia/pytorch:25.06-py3

WORKDIR /workspace/megatron_rlhf
# The image's torch must stay. Packages that need torch (megatron-core, this project) go in with
# --no-deps, so pip never re-resolves torch; the others do not depend on it.
COPY setup.py pyproject.toml ./
RUN pip install --no-cache-dir einops numpy sentencepiece "omegaconf>=2.3" tqdm tensorboard \
      safetensors matplotlib pyarrow "pytest>=8" pytest-timeout \
 && pip install --no-cache-dir --no-deps "megatron-core==0.16.1"
COPY . .
RUN pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, megatron.core, megatron_rlhf; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__)"
ENV PYTHONUNBUFFERED=1
CMD ["bash", "scripts/gpu_check.sh"]
