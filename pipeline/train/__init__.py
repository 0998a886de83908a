"""Training: `run(cfg)` (pipeline.train.trainer) behind `tlf train` and `python -m pipeline.train`."""
