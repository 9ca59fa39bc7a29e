"""Install megatron_rl and moe_routing.

torch is bounded above by 2.13.0 so that a CPU machine that installed the 2.13.0 CPU build
keeps it (anything newer would pull a CUDA build and its multi-GB dependencies); GPU users
install the CUDA build of torch first, and pip leaves it in place.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Megatron-Core extension for RL post-training of Mixture-of-Experts LLMs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "moe_routing", "moe_routing.*"]),
    package_data={"megatron_rl": ["py.typed", "assets/**/*"]},
    install_requires=[
        "torch>=2.6,<=2.13.0",
        # 0.16.1 on Python 3.11 (the newest release there); 0.17+ need Python 3.12 (tools/py312_env.sh tests 0.19.2).
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "pyyaml>=6",
        # megatron-core's distributed checkpoint writer measures worker memory with psutil.
        "psutil",
        "tqdm",
        "safetensors>=0.4",
        # 5.24: the hf rollout engine passes the KV cache as cache= (rollout/local/hf_model.py).
        "transformers>=5.24",
        "tokenizers",
        # Prompt files (JSONL / Parquet) are read with Hugging Face datasets.
        "datasets>=3",
        # The built-in math reward (brings its LaTeX parser and the ANTLR runtime).
        "math-verify>=0.7",
        "nvidia-ml-py",
        "tensorboard",
        "matplotlib",
        # The SGLang rollout client (and the SGLang-protocol server the tests run) speak HTTP
        # through aiohttp; SGLang itself stays an optional extra for GPU nodes.
        "aiohttp>=3.9",
        # Weight-sync payloads are base64 as SGLang writes and reads them, with its codec (SIMD;
        # the standard library's is several times slower on a bucket of hundreds of MB).
        "pybase64>=1.4",
    ],
    extras_require={
        # The tests log real W&B offline runs and MLflow file-store runs and read them back with
        # the libraries' own readers: wandb.sdk.internal.datastore, which 0.30 dropped, hence
        # the bound (the "wandb" extra has none).
        # pytest-xdist: the suite runs as two workers, one test file each at a time (the e2e
        # tests spend much of their time waiting on servers and process starts).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "wandb>=0.19,<0.30", "mlflow-skinny>=3.0"],
        # Trackers (logging.wandb, logging.mlflow). mlflow-skinny is MLflow's client: servers
        # and file stores; a local database store (sqlite://) needs the full "mlflow" package.
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=3.0"],
        # GPU-only extras: install CUDA torch first (see README), never on a CPU machine.
        "sglang": ["sglang==0.5.23"],
        "te": ["transformer-engine[pytorch]>=2.0"],
    },
    entry_points={
        "console_scripts": [
            "megatron-rl-train = megatron_rl.train.main:cli",
            "megatron-rl-launch = megatron_rl.launcher:main",
            "megatron-rl-convert-hf-to-megatron = megatron_rl.checkpoint.cli:hf_to_megatron_main",
            "megatron-rl-convert-megatron-to-hf = megatron_rl.checkpoint.cli:megatron_to_hf_main",
            "megatron-rl-logprob-parity = megatron_rl.checkpoint.cli:parity_main",
            "megatron-rl-export-fp8 = megatron_rl.checkpoint.cli:export_fp8_main",
            "megatron-rl-smoke = megatron_rl.smoke:main",
            "megatron-rl-plan = megatron_rl.plan.cli:main",
            "megatron-rl-mismatch = megatron_rl.mismatch_cli:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
