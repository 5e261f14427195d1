from setuptools import find_packages, setup

setup(
    name="megatron-longctx",
    version="0.1.0",
    description="Context-parallel attention, activation offloading and recompute for Megatron-Core, "
    "without Transformer Engine and without forking Megatron.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_longctx", "megatron_longctx.*"]),
    python_requires=">=3.10",
    # Supported Megatron-Core: 0.16.1 (python 3.10/3.11) through 0.19.x (python >= 3.12).
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "packaging",
        "psutil",  # Megatron-Core's checkpoint writer
        "einops",  # Megatron-Core builds hierarchical CP groups (a2a+p2p) with it
    ],
    extras_require={
        "test": ["pytest>=8"],
        "bench": ["matplotlib", "tqdm"],
        # the peers python -m megatron_longctx.bench.peers sets side by side (never needed by the plugin)
        "peers": ["deepspeed"],
        # CUDA-only; Transformer Engine as megatron-core 0.19.2's own "te" extra requires it. NVIDIA apex
        # comes with the NGC container (PyPI's "apex" is an unrelated package).
        "gpu": ["transformer-engine[core_cu13,pytorch]", "flash-attn", "nvidia-modelopt"],
    },
    entry_points={"console_scripts": ["megatron-longctx=megatron_longctx.cli:main"]},
)
