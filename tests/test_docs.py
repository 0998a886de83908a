"""The README's config reference is generated from the dataclasses and must be current."""

from pipeline import docs


def test_config_reference_is_current():
    text = docs.README.read_text()
    assert docs.render(text) == text, "README.md config reference is stale: run `python -m pipeline.docs`"
    for key in ("`model.router_threshold`", "`train.global_batch_size`", "`shard_tokens`"):
        assert key in text
