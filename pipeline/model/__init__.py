from pipeline.model.looped import LoopedLM, LoopedLMOutput
from pipeline.model.router import Router, RouterOutput, depth_stats

__all__ = ["LoopedLM", "LoopedLMOutput", "Router", "RouterOutput", "depth_stats"]
