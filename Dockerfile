# megatron-longctx on NVIDIA's NGC PyTorch container.
#
# Base image: nvcr.io/nvidia/pytorch:26.06-py3, the NGC release Megatron-LM's own CI builds and tests
# megatron-core's 0.19 line against.  Evidence (read off github.com/NVIDIA/Megatron-LM, snapshot of
# 2026-08-22): `git show core_r0.19.0:docker/.ngc_version.dev` prints nvcr.io/nvidia/pytorch:26.06-py3
# (the same at tag core_v0.19.0).  It brings what megatron-core 0.19.2 needs and what this package's `gpu`
# extra names, built against one CUDA:
#   * Python 3.12 (megatron-core 0.19 requires >= 3.12);
#   * NVIDIA's CUDA build of PyTorch (megatron-core requires torch >= 2.6), with triton;
#   * Transformer Engine, flash-attn and NVIDIA apex, matched to that PyTorch and CUDA.
# Nothing below may replace them: megatron-core and this package are installed with --no-deps (their
# remaining requirements, numpy and packaging, are in the image), and the build fails if torch changed.
# Another NGC release: --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3 (Python 3.12 required).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

ARG MEGATRON_CORE_VERSION=0.19.2
# Megatron-LM's training scripts (pretrain_gpt.py) of the same release; the recipes run them unmodified.
# There is no tag core_v0.19.2 (`git tag -l 'core_v0.19*'` lists only core_v0.19.0); the release branch
# core_r0.19.0 at commit f8837c04ef6c (2026-08-20) holds a megatron/training identical to the 0.19.2
# wheel's, so the scripts are fetched at that commit of that branch.
ARG MEGATRON_LM_REF=core_r0.19.0
ARG MEGATRON_LM_COMMIT=f8837c04ef6cbef6cdefb8de001aad63178aebbf

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    MEGATRON_LM=/opt/Megatron-LM

# One Megatron tree per process: the launcher puts the script's folder first on sys.path (as `python
# pretrain_gpt.py` does), so the checkout's megatron/ folder would shadow the installed wheel (and its
# compiled dataset helpers).  The scripts stay, the checkout's package goes: megatron-core 0.19.2 from pip is
# the one tree.
RUN python -c "import sys, torch; assert sys.version_info[:2] == (3, 12), sys.version; print(torch.__version__)" \
        > /opt/image-torch-version \
 && python -m pip install --no-deps "megatron-core==${MEGATRON_CORE_VERSION}" \
 && git clone --depth 50 --branch "${MEGATRON_LM_REF}" https://github.com/NVIDIA/Megatron-LM.git "${MEGATRON_LM}" \
 && git -C "${MEGATRON_LM}" checkout --quiet "${MEGATRON_LM_COMMIT}" \
 && rm -rf "${MEGATRON_LM}/.git" "${MEGATRON_LM}/megatron"

COPY . /opt/megatron-longctx
RUN python -m pip install --no-deps /opt/megatron-longctx \
 && python -c "import torch; assert torch.__version__ == open('/opt/image-torch-version').read().strip(), \
'the image torch was replaced'" \
 && python -c "import megatron.core, megatron_longctx, transformer_engine; \
print('megatron-core', megatron.core.__version__, '| megatron-longctx', megatron_longctx.__version__)" \
 && cd "${MEGATRON_LM}" && python -c "import megatron.core.datasets.helpers_cpp as h; \
assert 'site-packages' in h.__file__, h.__file__"

WORKDIR /workspace
