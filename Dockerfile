# megatron_rlhf on an NGC PyTorch container (CUDA torch, Transformer Engine and Apex included).
# Build:  docker build -t megatron_rlhf .
# Check:  docker run --gpus all --ipc=host megatron_rlhf          # scripts/gpu_check.sh (<10 min)
# Train:  docker run --gpus all --ipc=host megatron_rlhf \
#           torchrun --nproc-per-node 8 tools/run_ppo.py \
#             --config examples/recipes/qwen2.5-7b-grpo-math-1x8.yaml
# Slurm (pyxis/enroot) takes the image as a squashfs file on shared storage:
#         enroot import -o megatron_rlhf.sqsh dockerd://megatron_rlhf   (examples/slurm/)
#
# megatron-core 0.16.1 is developed against Transformer Engine 2.9 to 2.11 (its "dev" extra):
# the build stops when the base image's TE is outside that range, unless REQUIRE_TE_RANGE=0.
# Another base: docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3 .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}
ARG REQUIRE_TE_RANGE=1

WORKDIR /workspace/megatron_rlhf
# The image's torch must stay. Packages that need torch (megatron-core, this project) go in with
# --no-deps, so pip never re-resolves torch; the others (setup.py's install_requires, checked by
# tests/test_deployment.py) do not depend on it.
COPY setup.py pyproject.toml ./
# hadolint ignore=DL3013
RUN pip install --no-cache-dir einops numpy sentencepiece tokenizers "jinja2>=3.1.6" \
      "omegaconf>=2.3" tqdm tensorboard safetensors matplotlib pyarrow "pytest>=8" \
      pytest-timeout \
 && pip install --no-cache-dir --no-deps "megatron-core==0.16.1"
COPY . .
# The smoke test imports the runner (every module a run needs) and parses the CLI.
RUN pip install --no-cache-dir --no-deps -e . \
 && python -c "import torch, megatron.core, megatron_rlhf.engine.run.runner; print('torch', \
torch.__version__, 'megatron-core', megatron.core.__version__)" \
 && python tools/run_ppo.py --help >/dev/null \
 && python scripts/check_te_version.py --min 2.9 --below 2.12 --required "${REQUIRE_TE_RANGE}"
ENV PYTHONUNBUFFERED=1
CMD ["bash", "scripts/gpu_check.sh"]
