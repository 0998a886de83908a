# The `transformers` wrapper of the exported modelling file. NOT imported by tlf: pipeline.hf.export appends this
# text to tlf's model source (pipeline/model/*.py with their tlf imports removed), so the file it writes,
# modeling_tlf.py, is self-contained and its math is tlf's by construction. Names used here but not defined
# (LoopedLM, FourierEmbedding, FOURIER_MAX_PERIOD, math, torch, F) come from that bundled source.
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class ModelConfig:
    """Stand-in for tlf's ModelConfig dataclass: the architecture fields as attributes."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def validate(self) -> None:
        pass


class TLFConfig(PretrainedConfig):
    model_type = "tlf_looped"

    def __init__(self, tlf_model: dict | None = None, loops_budget: int | None = None, **kw):
        self.tlf_model = dict(tlf_model or {})  # every tlf ModelConfig field (loops L, router_threshold, ...)
        loops = kw.pop("loops", None)  # config.json's `loops` is L; its `loops_budget` M wins when both are there
        self.loops_budget = loops_budget if loops_budget is not None else loops  # default budget M (None: M = L)
        # tied: lm_head.weight is not in the file and transformers ties it to wte after loading (post_init,
        # from_pretrained), so fine-tuning trains one matrix, as tlf does (config.json says so)
        kw.setdefault("tie_word_embeddings", True)
        super().__init__(**kw)

    def __setattr__(self, key, value):
        # `loops` and `loops_budget` are one setting, the default budget M: from_pretrained(..., loops=2) (and so
        # lm-eval's --model_args ...,loops=2) sets it after __init__, under either name
        if key in ("loops", "loops_budget"):
            value = self._budget(key, value)
            super().__setattr__("loops", value)
            key = "loops_budget"
        super().__setattr__(key, value)

    def _budget(self, key, value):
        L = getattr(self, "tlf_model", {}).get("loops")
        if value is None:
            return L
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (L is not None and value > L):
            raise ValueError(f"{key}={value!r}: the loop budget must be an integer in 1..{L} (the model's loops L)")
        return value


class TLFPreTrainedModel(PreTrainedModel):
    config_class = TLFConfig
    base_model_prefix = "model"
    _tied_weights_keys = ["model.lm_head.weight"]  # with tie_word_embeddings: wte's matrix, not in the file
    _supports_cache_class = False

    def _init_weights(self, module):
        if isinstance(module, FourierEmbedding):  # the non-persistent frequency buffer is not in the weights
            half = module.freqs.numel()
            mp = FOURIER_MAX_PERIOD
            module.freqs = torch.exp(-math.log(mp) * torch.arange(half, dtype=torch.float32) / half)


class TLFForCausalLM(TLFPreTrainedModel, GenerationMixin):
    """tlf's LoopedLM (router, gather-scatter, elastic budget). No KV cache: generate() recomputes the whole
    prefix each step (exact). attention_mask: each row's real tokens (one contiguous run, i.e. left or right
    padding) run as their own sequence from position 0, exactly as tlf runs that row unpadded."""

    def __init__(self, config: TLFConfig):
        super().__init__(config)
        self.model = LoopedLM(ModelConfig(config.tlf_model))
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    def _logits(self, ids, M):  # (B, T) -> (B, T, V)
        return self.model(ids, loops=M).logits

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        loops=None,
        past_key_values=None,
        use_cache=None,
        return_dict=None,
        **kwargs,
    ):
        M = loops or self.config.loops_budget or self.config.tlf_model["loops"]
        T, block = input_ids.shape[-1], self.config.tlf_model["block_size"]
        if T > block:  # positions are learned up to block_size: longer input has no position to take
            raise ValueError(
                f"input length {T} exceeds the model's block_size {block} (max_position_embeddings): truncate the "
                f"input (tokenizer(..., truncation=True, max_length={block})) or ask generate() for fewer tokens"
            )
        if attention_mask is None or bool(attention_mask.bool().all()):
            logits = self._logits(input_ids, M)
        else:
            keep = attention_mask.bool()  # (B, T)
            logits = None
            for b in range(input_ids.shape[0]):
                row = self._logits(input_ids[b : b + 1, keep[b]], M)[0]  # (n_b, V)
                if logits is None:
                    logits = row.new_zeros(*input_ids.shape, row.shape[-1])
                logits[b, keep[b]] = row
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, loops=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loops": loops}
