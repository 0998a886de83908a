"""The configuration reference (docs/configuration.md) is generated from the dataclasses and must be current; the
README holds none (it links there)."""

from pipeline import docs


def test_config_reference_is_current():
    text = docs.TARGET.read_text()
    assert docs.render(text) == text, "docs/configuration.md's config reference is stale: run `python -m pipeline.docs`"
    for key in ("`model.router_threshold`", "`train.global_batch_size`", "`shard_tokens`"):
        assert key in text
    assert docs.main(["--check"]) == 0


def test_the_readme_links_the_reference_instead_of_holding_it():
    readme = (docs.TARGET.parent.parent / "README.md").read_text()
    assert docs.START not in readme and "docs/configuration.md" in readme
