"""Training: `run(cfg)` = `Trainer.build(cfg).fit()` (pipeline.train.trainer, callbacks in pipeline.train.callbacks) behind `tlf train` and `python -m pipeline.train`."""
