"""tlf: the pretraining pipeline for T-LoopFormer looped transformers."""

__version__ = "0.1.0"
