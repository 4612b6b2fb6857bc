"""Tests for gsm8k.py: normalisation, extraction, scoring, loading, prompts.

Runs on CPU in a few seconds.  The real GSM8K files are looked for where the trainer looks (tasks.local_gsm8k_dir:
./data/gsm8k or ../shared/data/gsm8k beside the repository); tests needing them are skipped if they are absent.
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsm8k
import tasks
from gsm8k import (
    INSTRUCTION,
    extract_answer,
    format_prompt,
    load_gsm8k,
    normalize_number,
    parse_gold_answer,
    score_response,
)

DATA_DIR = Path(tasks.local_gsm8k_dir() or "data/gsm8k")
needs_real_data = pytest.mark.skipif(not (DATA_DIR / "test.jsonl").is_file(), reason="real GSM8K files not available")


def write_jsonl(path: Path, records: list) -> Path:
    """Write one JSON value per line and return the path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


GOOD_ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "How many cents in $12?", "answer": "12 * 100 = 1200\n#### 1,200"},
    {"question": "What is 3 - 10?", "answer": "3 - 10 = -7\n#### -7"},
]


# ---------------------------------------------------------------------------
# normalize_number / parse_gold_answer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", "5"),
        ("  42\n", "42"),
        ("1,234", "1234"),
        ("1,234,567", "1234567"),
        ("$1,234.50", "1234.5"),
        ("$12", "12"),
        ("-5", "-5"),
        ("+5", "5"),
        ("\u22125", "-5"),
        ("-$5", "-5"),
        ("$-5", "-5"),
        ("5.0", "5"),
        ("5.00", "5"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("-.5", "-0.5"),
        ("007", "7"),
        ("100", "100"),
        ("-0", "0"),
        ("0.000", "0"),
        ("5.", "5"),
        ("5%", "5"),
        ("12.5 %", "12.5"),
        ("5 apples", "5"),
        ("20 dollars.", "20"),
        # exactness: more digits than a float (or Decimal's default 28) holds
        ("12345678901234567890123456789012.10", "12345678901234567890123456789012.1"),
        ("0.1000000000000000000000000000000001", "0.1000000000000000000000000000000001"),
        # not numbers
        ("", None),
        ("   ", None),
        ("abc", None),
        ("five", None),
        ("1/2", None),
        ("1e5", None),
        ("5kg", None),
        ("1,23", None),
        ("12,34,567", None),
        ("1.2.3", None),
        ("--5", None),
        ("-$-5", None),
        ("$", None),
        (".", None),
        ("inf", None),
        ("nan", None),
        ("5 3", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_normalize_number_rejects_non_strings():
    with pytest.raises(TypeError, match="int"):
        normalize_number(5)


@settings(deadline=None)  # no per-example time limit: a loaded machine must not fail a correctness test
@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_normalize_number_integer_formats_agree(value):
    """Plain, comma-grouped, dollar and '.00' spellings all give str(value)."""
    grouped = f"{value:,}"
    assert normalize_number(str(value)) == str(value)
    assert normalize_number(grouped) == str(value)
    assert normalize_number(grouped + ".00") == str(value)
    sign = "-" if value < 0 else ""
    assert normalize_number(f"{sign}${abs(value):,}") == str(value)


@settings(deadline=None)
@given(st.decimals(allow_nan=False, allow_infinity=False, places=6))
def test_normalize_number_is_exact_and_idempotent(value):
    """The canonical form denotes the same Decimal, and is a fixed point."""
    text = format(value, "f")
    canonical = normalize_number(text)
    assert canonical is not None
    assert Decimal(canonical) == value
    assert normalize_number(canonical) == canonical
    assert "e" not in canonical.lower()
    if "." in canonical:
        assert not canonical.endswith("0")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Some steps.\n#### 18", "18"),
        ("#### 1,450,000", "1450000"),
        ("steps\n#### -3", "-3"),
        ("first #### 4 then\n#### 7", "7"),
        ("#### 7\nTrailing explanation 99", "7"),
        ("#### 0.50", "0.5"),
        ("####  12 ", "12"),
        ("no marker, answer is 5", None),
        ("#### five", None),
        ("#### ", None),
        ("", None),
    ],
)
def test_parse_gold_answer(answer, expected):
    assert parse_gold_answer(answer) == expected


# ---------------------------------------------------------------------------
# extract_answer / score_response on hand-written responses
# ---------------------------------------------------------------------------

# (response, gold, strict score, flexible score)
TRICKY_RESPONSES = [
    pytest.param("So the total is 18.\n#### 18", "18", 1.0, 1.0, id="plain"),
    pytest.param("#### 1,234", "1234", 1.0, 1.0, id="thousands-comma"),
    pytest.param("#### 1234", "1,234", 1.0, 1.0, id="comma-in-gold-only"),
    pytest.param("#### 1,234,567.00", "1234567", 1.0, 1.0, id="two-commas-and-.00"),
    pytest.param("#### $12", "12", 1.0, 1.0, id="dollar"),
    pytest.param("It costs $1,200 in total.", "1200", 0.0, 1.0, id="dollar-comma-no-marker"),
    pytest.param("#### 5.0", "5", 1.0, 1.0, id="trailing-.0"),
    pytest.param("#### 5.00", "5", 1.0, 1.0, id="trailing-.00"),
    pytest.param("#### 5.5", "5", 0.0, 0.0, id="real-decimal-differs"),
    pytest.param("#### -3", "-3", 1.0, 1.0, id="negative"),
    pytest.param("#### \u22123", "-3", 1.0, 1.0, id="unicode-minus"),
    pytest.param("#### 3", "-3", 0.0, 0.0, id="sign-matters"),
    pytest.param("#### -$4", "-4", 1.0, 1.0, id="negative-dollar"),
    pytest.param("#### 4\nWait, recheck.\n#### 6", "6", 1.0, 1.0, id="last-marker-wins"),
    pytest.param("#### 6\nWait, recheck.\n#### 4", "6", 0.0, 0.0, id="earlier-marker-ignored"),
    pytest.param("#### 6\nfinal: ####", "6", 0.0, 1.0, id="empty-last-marker"),
    pytest.param("The answer is 42.", "42", 0.0, 1.0, id="sentence-period-no-marker"),
    pytest.param("#### 42.", "42", 1.0, 1.0, id="marker-sentence-period"),
    pytest.param("#### 5 apples", "5", 1.0, 1.0, id="marker-with-unit"),
    pytest.param("#### 5 apples", "6", 0.0, 0.0, id="marker-with-unit-wrong"),
    pytest.param("I think 3 + 4 = 7", "7", 0.0, 1.0, id="no-marker-last-number"),
    pytest.param("I think 7, not 3", "7", 0.0, 0.0, id="no-marker-last-number-wrong"),
    pytest.param("#### 7 (since 3 + 4 = 7, not 8)", "7", 1.0, 0.0, id="strict-vs-flexible"),
    pytest.param("#### 0.5", "0.5", 1.0, 1.0, id="decimal"),
    pytest.param("#### .5", "0.5", 1.0, 1.0, id="bare-decimal"),
    pytest.param("#### 0.50", ".5", 1.0, 1.0, id="decimal-both-sides-differ"),
    pytest.param("#### 25%", "25", 1.0, 1.0, id="percent"),
    pytest.param("The rate rose by 25%.", "25", 0.0, 1.0, id="percent-no-marker"),
    pytest.param("#### 0.25", "25", 0.0, 0.0, id="percent-not-rescaled"),
    pytest.param("Use formula x2 and abc123def", "2", 0.0, 0.0, id="numbers-inside-words"),
    pytest.param("Step 2: H2O", "2", 0.0, 1.0, id="word-digit-ignored"),
    pytest.param("", "5", 0.0, 0.0, id="empty-response"),
    pytest.param("I don't know.", "5", 0.0, 0.0, id="no-number"),
    pytest.param("####5", "5", 1.0, 1.0, id="marker-without-space"),
    pytest.param("#### x = 5", "5", 0.0, 1.0, id="marker-not-followed-by-number"),
    pytest.param("#### **5**", "5", 0.0, 1.0, id="markdown-bold-after-marker"),
    pytest.param("#### 1,23", "1", 0.0, 0.0, id="malformed-grouping"),
    pytest.param("The range is 3-5", "5", 0.0, 1.0, id="hyphen-is-not-minus"),
    pytest.param("so x = -5", "-5", 0.0, 1.0, id="negative-in-text"),
    pytest.param("version 1.2.3", "3", 0.0, 0.0, id="dotted-version"),
    pytest.param("#### 12345678901234567890", "12345678901234567890", 1.0, 1.0, id="huge"),
    pytest.param("#### 12345678901234567891", "12345678901234567890", 0.0, 0.0, id="huge-off-by-one"),
]


@pytest.mark.parametrize(("response", "gold", "strict", "flexible"), TRICKY_RESPONSES)
def test_tricky_responses(response, gold, strict, flexible):
    assert score_response(response, gold, mode="strict") == strict
    assert score_response(response, gold, mode="flexible") == flexible


def test_tricky_table_is_large_and_nontrivial():
    """The table covers >= 25 cases and both outcomes in each mode."""
    assert len(TRICKY_RESPONSES) >= 25
    for column in (2, 3):
        assert {p.values[column] for p in TRICKY_RESPONSES} == {0.0, 1.0}


@pytest.mark.parametrize(
    ("response", "strict", "flexible"),
    [
        ("#### 1,234.50", "1234.5", "1234.5"),
        ("#### 4\nthen\n#### -$7.", "-7", "-7"),
        ("answer 12 or 13", None, "13"),
        ("#### 3 pens cost $4.50", "3", "4.5"),
        ("", None, None),
    ],
)
def test_extract_answer_values(response, strict, flexible):
    assert extract_answer(response) == strict
    assert extract_answer(response, mode="strict") == strict
    assert extract_answer(response, mode="flexible") == flexible


def test_extract_answer_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="'fuzzy'") as info:
        extract_answer("#### 5", mode="fuzzy")
    assert "'strict'" in str(info.value) and "'flexible'" in str(info.value)
    with pytest.raises(ValueError, match="'fuzzy'"):
        score_response("#### 5", "5", mode="fuzzy")


def test_format_bonus():
    # Well formed and right: 1 + bonus (so the total can exceed 1).
    assert score_response("#### 5", "5", format_bonus=0.1) == pytest.approx(1.1)
    # Well formed but wrong: bonus only.
    assert score_response("#### 6", "5", format_bonus=0.1) == pytest.approx(0.1)
    # Right in flexible mode but no marker: no bonus.
    assert score_response("it is 5", "5", mode="flexible", format_bonus=0.1) == 1.0
    # A marker with no number after it is not well formed.
    assert score_response("#### five", "5", format_bonus=0.1) == 0.0
    assert score_response("#### 6", "5", mode="flexible", format_bonus=0.25) == 0.25
    # Default: no bonus.
    assert score_response("#### 6", "5") == 0.0


@pytest.mark.parametrize("bad", [-0.1, -1, float("nan"), float("inf")])
def test_format_bonus_must_be_non_negative_and_finite(bad):
    with pytest.raises(ValueError, match="format_bonus"):
        score_response("#### 5", "5", format_bonus=bad)


def test_non_numeric_gold_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="'five'"):
        score_response("#### 5", "five")


# ---------------------------------------------------------------------------
# Real GSM8K data
# ---------------------------------------------------------------------------


@needs_real_data
def test_real_test_split_scores_against_itself_and_shifted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped row must not go unnoticed
        rows, skipped = load_gsm8k(str(DATA_DIR), split="test")
    assert skipped == 0
    assert len(rows) == 1319
    shifted_checked = 0
    for i, row in enumerate(rows):
        assert row["gold"] == parse_gold_answer(row["answer"])
        for mode in ("strict", "flexible"):
            assert score_response(row["answer"], row["gold"], mode=mode) == 1.0, (i, mode)
        # The next item (cyclically) whose gold differs from this one.
        n = len(rows)
        j = next(k % n for k in range(i + 1, i + n) if rows[k % n]["gold"] != row["gold"])
        for mode in ("strict", "flexible"):
            assert score_response(rows[j]["answer"], row["gold"], mode=mode) == 0.0, (i, j, mode)
        shifted_checked += 1
    assert shifted_checked == 1319


@needs_real_data
def test_real_train_split_loads_completely():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows, skipped = load_gsm8k(str(DATA_DIR / "train.jsonl"))
    assert (len(rows), skipped) == (7473, 0)
    assert all(set(r) == {"question", "answer", "gold"} for r in rows)
    # Raw answers are kept verbatim; some golds use thousands separators.
    assert any("," in r["answer"].rsplit("####", 1)[1] for r in rows)
    assert all("," not in r["gold"] for r in rows)


# ---------------------------------------------------------------------------
# Loader on small local files
# ---------------------------------------------------------------------------


def test_load_from_directory_and_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GOOD_ROWS)
    write_jsonl(tmp_path / "test.jsonl", GOOD_ROWS[:1])
    rows, skipped = load_gsm8k(str(tmp_path))
    assert skipped == 0
    assert [r["gold"] for r in rows] == ["5", "1200", "-7"]
    assert rows[1] == {
        "question": GOOD_ROWS[1]["question"],
        "answer": GOOD_ROWS[1]["answer"],
        "gold": "1200",
    }
    rows, _ = load_gsm8k(str(tmp_path), split="test")
    assert [r["gold"] for r in rows] == ["5"]
    rows, _ = load_gsm8k(str(tmp_path / "train.jsonl"), split="ignored-for-files")
    assert len(rows) == 3


def test_load_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(GOOD_ROWS[0]) + "\n\n" + json.dumps(GOOD_ROWS[1]) + "\n\n")
    rows, skipped = load_gsm8k(str(path))
    assert (len(rows), skipped) == (2, 0)


def test_load_limit(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GOOD_ROWS)
    rows, skipped = load_gsm8k(str(tmp_path), limit=2)
    assert [r["gold"] for r in rows] == ["5", "1200"]
    assert skipped == 0
    rows, _ = load_gsm8k(str(tmp_path), limit=100)
    assert len(rows) == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            load_gsm8k(str(tmp_path), limit=bad)


def test_load_limit_counts_kept_rows_and_stops_reading(tmp_path):
    path = tmp_path / "d.jsonl"
    bad = {"question": "q", "answer": "#### lots"}
    lines = [json.dumps(bad), json.dumps(GOOD_ROWS[0]), json.dumps(GOOD_ROWS[1]), "{not json"]
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="line 1"):
        rows, skipped = load_gsm8k(str(path), limit=2)
    assert ([r["gold"] for r in rows], skipped) == (["5", "1200"], 1)


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = [*GOOD_ROWS, {"question": "q?", "answer": "#### n/a"}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "test.parquet")
    with pytest.warns(UserWarning, match=r"skipped 1 .*row 3.*n/a"):
        rows, skipped = load_gsm8k(str(tmp_path), split="test")
    assert [r["gold"] for r in rows] == ["5", "1200", "-7"]
    assert skipped == 1
    rows, _ = load_gsm8k(str(tmp_path / "test.parquet"), limit=1)
    assert [r["gold"] for r in rows] == ["5"]


def test_directory_prefers_jsonl_over_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(GOOD_ROWS), tmp_path / "train.parquet")
    write_jsonl(tmp_path / "train.jsonl", GOOD_ROWS[:1])
    rows, _ = load_gsm8k(str(tmp_path))
    assert len(rows) == 1


def test_empty_parquet_is_an_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    path = tmp_path / "train.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(ValueError, match=r"empty.*train\.parquet"):
        load_gsm8k(str(path))


def test_missing_local_paths(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_gsm8k(str(missing))
    for source in ("data.jsonl", "./gsm8k", "/no/such/dir", "a/b/c", "~/no_such_gsm8k_dir"):
        with pytest.raises(FileNotFoundError, match=re.escape(source)):
            load_gsm8k(source)
    # An existing directory without the split file names both candidates.
    expected = r"'validation'.*validation\.jsonl.*validation\.parquet"
    with pytest.raises(FileNotFoundError, match=expected):
        load_gsm8k(str(tmp_path), split="validation")


def test_empty_file_is_an_error(tmp_path):
    for content in ("", "\n\n  \n"):
        path = tmp_path / "train.jsonl"
        path.write_text(content)
        with pytest.raises(ValueError, match=f"empty.*{re.escape(str(path))}"):
            load_gsm8k(str(path))


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]) + "\n" + '{"question": "q", "answer": \n')
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*line 2.*invalid JSON"):
        load_gsm8k(str(tmp_path))


def one_line_error(path) -> str:
    """load_gsm8k's refusal of `path`: a plain ValueError whose message is one line."""
    with pytest.raises(ValueError) as info:
        load_gsm8k(str(path))
    assert type(info.value) is ValueError and "\n" not in str(info.value)
    return str(info.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    """A latin-1 byte in a JSON-lines file (--dataset PATH): a ValueError naming the file, the line, the byte and its
    offset (today: Python's 'utf-8' codec can't decode byte 0xe9 in position N, position in a chunk, no file)."""
    path = tmp_path / "train.jsonl"
    path.write_bytes((json.dumps(GOOD_ROWS[0]) + "\n").encode() + b'{"question": "caf\xe9?", "answer": "#### 3"}\n')
    offset = len(json.dumps(GOOD_ROWS[0])) + 1 + len('{"question": "caf')
    message = one_line_error(tmp_path)
    assert message.startswith(f"{path}: line 2: not UTF-8 text (byte 0xe9 at byte offset {offset}"), message


def test_a_parquet_value_that_is_not_utf8_is_named(tmp_path):
    """A parquet text column holding a latin-1 byte: the file, the row and the column named (today: Python's
    'utf-8' codec error, without the file)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    questions = pa.array([b"q?", b"caf\xe9?"], pa.binary()).view(pa.string())  # not validated: a foreign writer's
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": questions, "answer": ["#### 5", "#### 3"]}), path)
    message = one_line_error(path)
    assert message.startswith(f"{path}: row 1, column 'question': not UTF-8 text (byte 0xe9"), message


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"train\.csv"):
        load_gsm8k(str(path))


def test_bad_rows_are_counted_and_reported_once(tmp_path):
    records = [
        GOOD_ROWS[0],
        {"question": "no answer field"},  # line 2
        {"answer": "#### 3"},  # line 3: no question
        {"question": "q", "answer": "text without a marker"},  # line 4
        GOOD_ROWS[1],
        {"question": "q", "answer": "#### twelve"},  # line 6
        {"question": "q", "answer": 12},  # line 7: answer not a string
        {"question": "", "answer": "#### 3"},  # line 8: empty question
        ["not", "an", "object"],  # line 9
        GOOD_ROWS[2],
    ]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.warns(UserWarning) as record:
        rows, skipped = load_gsm8k(str(path))
    assert len(record) == 1, "all skips must be reported in a single warning"
    message = str(record[0].message)
    assert skipped == 7
    assert [r["gold"] for r in rows] == ["5", "1200", "-7"]
    assert str(path) in message
    assert "skipped 7" in message
    # The first few offenders are named, with what was wrong.
    fragments = ("line 2", "'answer' missing", "line 3", "'question' missing", "line 4", "line 6")
    for fragment in (*fragments, "twelve"):
        assert fragment in message, fragment
    assert "line 9" not in message  # only the first few are listed ...
    assert message.endswith("...)")  # ... and the rest elided


def test_all_rows_bad_is_an_error(tmp_path):
    records = [{"question": "q", "answer": "#### abc"}, {"q": 1}]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(ValueError, match=r"all 2 rows.*abc"):
        load_gsm8k(str(path))


# ---------------------------------------------------------------------------
# Loader via a Hugging Face id (never touches the network)
# ---------------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace datasets.load_dataset with an in-memory GSM8K; record calls."""
    datasets = pytest.importorskip("datasets")
    calls = []
    table = {
        "train": [*GOOD_ROWS, {"question": "bad", "answer": "#### ?"}],
        "test": GOOD_ROWS[:2],
    }

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if path != "openai/gsm8k":
            raise FileNotFoundError(f"Dataset {path} doesn't exist on the Hub")
        return datasets.Dataset.from_list(table[split])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return calls


def test_load_from_hf_id(fake_hub):
    rows, skipped = load_gsm8k("openai/gsm8k", split="test")
    assert fake_hub == [("openai/gsm8k", "main", "test")]
    assert (len(rows), skipped) == (2, 0)
    assert rows[1]["gold"] == "1200"

    with pytest.warns(UserWarning, match=r"openai/gsm8k.*skipped 1.*row 3"):
        rows, skipped = load_gsm8k("openai/gsm8k", split="train", config="socratic")
    assert fake_hub[-1] == ("openai/gsm8k", "socratic", "train")
    assert (len(rows), skipped) == (3, 1)

    rows, _ = load_gsm8k("openai/gsm8k", limit=1)
    assert [r["gold"] for r in rows] == ["5"]


def test_hf_id_errors_explain_the_fallback(fake_hub):
    with pytest.raises(FileNotFoundError) as info:
        load_gsm8k("someone/missing")
    assert fake_hub == [("someone/missing", "main", "train")]
    assert any("Hugging Face dataset id" in note for note in info.value.__notes__)


def test_hf_id_without_datasets_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match="pip install datasets"):
        load_gsm8k("openai/gsm8k")


def test_local_dataset_directory_is_not_mistaken_for_hf_id(tmp_path, monkeypatch, fake_hub):
    """A relative path that exists is read locally even if it looks like an id."""
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    write_jsonl(tmp_path / "openai" / "gsm8k" / "train.jsonl", GOOD_ROWS[:1])
    monkeypatch.chdir(tmp_path)
    rows, _ = load_gsm8k("openai/gsm8k")
    assert fake_hub == []
    assert [r["gold"] for r in rows] == ["5"]


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def test_format_prompt():
    question = "  Tom has 3 apples and buys 2 more. How many now?\n"
    prompt = format_prompt(question)
    assert prompt.startswith("Tom has 3 apples")
    assert prompt.endswith(INSTRUCTION)
    assert "####" in INSTRUCTION and "step by step" in INSTRUCTION
    # The answer format the instruction asks for is what strict mode reads.
    assert score_response(prompt + "\n3 + 2 = 5\n#### 5", "5") == 1.0
    for bad in ("", "   "):
        with pytest.raises(ValueError, match="question"):
            format_prompt(bad)


def test_public_api():
    for name in gsm8k.__all__:
        assert hasattr(gsm8k, name), name
        if callable(getattr(gsm8k, name)):
            assert getattr(gsm8k, name).__doc__, name
