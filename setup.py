from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
configs = [(f"share/tlf/{p.parent}", [str(p)]) for p in sorted(here.glob("configs/**/*.yaml"))]
ds_configs = [("share/tlf/ds_configs", [str(p) for p in sorted(here.glob("ds_configs/*.json"))])]

setup(
    name="tlf",
    version="0.1.0",
    description="Pretraining pipeline for T-LoopFormer looped transformers",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["pipeline*", "data_prep*", "evaluation*"]),
    package_data={"pipeline": ["removed.yaml"]},  # the table of keys configs no longer have (pipeline/config.py)
    data_files=configs + ds_configs,
    install_requires=[
        "torch>=2.3",
        "numpy>=1.24",
        "click>=8.1",
        "PyYAML>=6.0",
        "tqdm>=4.60",
        "tiktoken>=0.6",
        "zstandard>=0.22",
        "pyarrow>=14",
        "datasets>=2.18",
        "mlflow>=2.12",
        "deepspeed>=0.14",
        "matplotlib>=3.7",
    ],
    extras_require={
        "dev": ["pytest>=8"],
        "harness": ["lm-eval>=0.4.5"],
        "hf": ["transformers>=4.40", "safetensors>=0.4", "accelerate>=0.26"],
    },
    entry_points={
        "console_scripts": ["tlf=pipeline.cli:entry"],
        # `tlf`'s subcommands: each package registers its own, so pipeline/cli.py never names a layer above it
        "tlf.commands": [
            "prep-data=data_prep.cli:prep_data",
            "data=data_prep.cli:data",
            "train=pipeline.train.cli:train",
            "generate=pipeline.inference.cli:generate",
            "sweep=pipeline.sweep:sweep",
            "export=pipeline.export:export_cmd",
            "eval=evaluation.cli:eval_cmd",
            "compare=evaluation.compare:compare",
            "ablate=evaluation.ablate:ablate",
            "plan=pipeline.plan.cli:plan_cmd",
        ],
        # training callbacks of the packages above pipeline, read by pipeline/train/callbacks.py default_callbacks()
        "tlf.callbacks": ["zeroshot=evaluation.in_training:ZeroShot"],
    },
)
