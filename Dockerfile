# megatron_rlhf on an NGC PyTorch container (CUDA torch, Transformer Engine and Apex included).
# Build:  docker build -t megatron_rlhf .
# Run:    docker run --gpus all --ipc=host megatron_rlhf \
#           torchrun --nproc-per-node 8 tools/run_ppo.py --placement separation --tp 8
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/megatron_rlhf
COPY . .
# The container's torch must stay: install our package without letting pip replace it.
RUN pip install --no-cache-dir "megatron-core==0.16.1" --no-deps \
 && pip install --no-cache-dir -e ".[test]"
ENV PYTHONUNBUFFERED=1
CMD ["torchrun", "--nproc-per-node", "8", "tools/run_ppo.py", "--placement", "separation", "--tp", "8"]
