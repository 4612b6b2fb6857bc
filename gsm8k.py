"""GSM8K data loading, answer extraction and reward scoring.

This module is deliberately free of torch so that it can be imported and
tested anywhere.  ``datasets`` (for Hugging Face ids) and ``pyarrow`` /
``pandas`` (for parquet files) are imported lazily, only when needed.

Answer conventions
------------------
GSM8K reference solutions end with a line ``#### <number>``.  Two ways of
reading a model's answer are offered, mirroring the two modes commonly used
for this benchmark (verl's gsm8k reward, for example, has a strict
``#### N`` mode and a flexible last-number mode):

* ``strict``: the number written right after the *last* ``####`` marker;
  no marker (or no number right after it) means no answer.
* ``flexible``: the last number appearing anywhere in the response.

Every number, gold or predicted, goes through :func:`normalize_number`
before comparison, so ``1,234``, ``$1234`` and ``1234.00`` all compare equal.

Normalisation decisions (see :func:`normalize_number`)
------------------------------------------------------
* Surrounding whitespace, a ``$`` sign (before or after the minus sign) and
  a single sentence-final ``.`` are removed.
* Commas are accepted only as proper thousands separators (``1,234,567``);
  ``1,23`` is not a number.
* ``+5`` becomes ``5``; the unicode minus ``\u2212`` is read as ``-``;
  ``-0`` becomes ``0``.
* Values are handled with :class:`decimal.Decimal` (never float), and written
  in plain positional notation without superfluous zeros: ``5.00`` -> ``5``,
  ``0.50`` -> ``0.5``, ``.5`` -> ``0.5``, ``007`` -> ``7``.
* A trailing ``%`` is dropped *without* rescaling (``5%`` -> ``5``), because
  GSM8K gold answers for percentage questions are written as the bare
  number.  Likewise trailing unit words separated by whitespace are dropped
  (``5 apples`` -> ``5``).  Letters glued to the number (``5kg``, ``1e5``)
  are rejected, since they are ambiguous.
* Scientific notation, fractions (``1/2``), ``inf`` and ``nan`` are not
  numbers here.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from decimal import Decimal, InvalidOperation, localcontext
from typing import Any

__all__ = [
    "EXTRACTION_MODES",
    "INSTRUCTION",
    "extract_answer",
    "format_prompt",
    "load_gsm8k",
    "normalize_number",
    "parse_gold_answer",
    "score_response",
]

#: Instruction appended to every GSM8K question for rollouts.
INSTRUCTION = (
    "Work through the problem step by step. When you are done, write the "
    "final answer on its own last line in the form '#### <number>', giving "
    "only the number (no units)."
)

#: Valid values for the ``mode`` argument of extract_answer / score_response.
EXTRACTION_MODES = ("strict", "flexible")

_UNICODE_MINUS = "\u2212"
_MARKER = "####"

# The digits of a number: grouped thousands ("1,234,567.5"), plain digits
# ("1234.5") or a bare fraction (".5").  The grouped form comes first so that
# "1,234" is read as one number rather than "1" followed by "234".
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"

# An optional sign and dollar sign in either order ("-$5", "$-5"), with no
# space between the sign and the digits: in "10 - 5" the 5 is not negative.
_PREFIX = r"(?:[-+\u2212]\$?|\$[-+\u2212]?)?"

# A number must not run on into more digits that it failed to absorb:
# "1,23" is not "1", and "1.2.3" is not "1.2".
_NO_MORE_DIGITS = r"(?![,.]?\d)"

# A number token inside running text.  It must not continue a word or
# another number ("abc123", "x2", "1.2.3" give no token), but it may be
# followed by letters, so "5kg" still yields 5 in running text.
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])" + _PREFIX + _DIGITS + _NO_MORE_DIGITS)

# The number right after the last "####" (spaces or tabs allowed between).
_NUMBER_AFTER_MARKER = re.compile(r"[ \t]*(" + _PREFIX + _DIGITS + _NO_MORE_DIGITS + ")")

# A whole string that is one number, optionally followed by "%" or by unit
# words separated by whitespace, and by one sentence-final period.
_WHOLE_NUMBER = re.compile(
    r"(?P<sign>[-+])?\$?(?P<sign2>[-+])?(?P<digits>" + _DIGITS + r")"
    r"(?:\s*%|(?:\s+[A-Za-z]+)+)?"
    r"\.?"
)


def normalize_number(text: str) -> str | None:
    """Return the canonical string form of the number in ``text``, or None.

    ``text`` must hold a single number, optionally decorated as described in
    the module docstring (``$``, thousands commas, sign, trailing ``.``,
    trailing ``%`` or unit words).  The result is exact (decimal arithmetic)
    and canonical: ``"$1,234.50"`` -> ``"1234.5"``, ``"-5.0"`` -> ``"-5"``,
    ``"+5"`` -> ``"5"``.  Anything that is not such a number (an empty
    string, ``"abc"``, ``"1/2"``, ``"1e5"``, ``"1,23"``) gives None.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize_number expects a str, got {type(text).__name__}")
    cleaned = text.strip().replace(_UNICODE_MINUS, "-")
    match = _WHOLE_NUMBER.fullmatch(cleaned)
    if match is None or (match["sign"] and match["sign2"]):
        return None
    negative = "-" in (match["sign"], match["sign2"])
    digits = match["digits"].replace(",", "")
    # Enough precision for every digit we were given, so nothing is rounded.
    with localcontext() as ctx:
        ctx.prec = max(28, len(digits) + 2)
        try:
            value = Decimal(digits)
        except InvalidOperation:  # pragma: no cover - the regex prevents this
            return None
        if value == 0:
            return "0"
        # normalize() drops trailing zeros; format "f" avoids exponents
        # (Decimal("1E+2") is written "100").
        canonical = format(value.normalize(), "f")
    return "-" + canonical if negative else canonical


def parse_gold_answer(answer: str) -> str | None:
    """Return the normalised gold number of a GSM8K reference solution.

    The gold is whatever follows the last ``#### `` marker, up to the end of
    that line, read with :func:`normalize_number`.  Returns None when there
    is no marker or the text after it is not a number.
    """
    if not isinstance(answer, str):
        raise TypeError(f"parse_gold_answer expects a str, got {type(answer).__name__}")
    position = answer.rfind(_MARKER)
    if position < 0:
        return None
    after_marker = answer[position + len(_MARKER) :]
    first_line = after_marker.lstrip(" \t").split("\n", 1)[0]
    return normalize_number(first_line)


def extract_answer(response: str, mode: str = "strict") -> str | None:
    """Extract the model's final numeric answer from ``response``.

    ``mode="strict"``: the number written immediately after the last
    ``####`` marker (spaces or tabs may separate them; anything after the
    number, such as ``apples`` in ``#### 5 apples``, is ignored).  None if
    there is no marker, or if the last marker is not followed by a number;
    earlier markers are never used as a fallback.

    ``mode="flexible"``: the last number anywhere in the response (which can
    include grouped thousands, a sign or a ``$``), or None if there is none.

    The answer is returned normalised (see :func:`normalize_number`).
    Raises ValueError for an unknown mode.
    """
    if mode not in EXTRACTION_MODES:
        raise ValueError(
            f"unknown extraction mode {mode!r}; valid modes are " + ", ".join(repr(m) for m in EXTRACTION_MODES)
        )
    if not isinstance(response, str):
        raise TypeError(f"extract_answer expects a str, got {type(response).__name__}")
    if mode == "strict":
        position = response.rfind(_MARKER)
        if position < 0:
            return None
        match = _NUMBER_AFTER_MARKER.match(response, position + len(_MARKER))
        return normalize_number(match.group(1)) if match else None
    tokens = _NUMBER_IN_TEXT.findall(response)
    return normalize_number(tokens[-1]) if tokens else None


def score_response(response: str, gold: str, mode: str = "strict", format_bonus: float = 0.0) -> float:
    """Reward for one response: correctness plus an optional format bonus.

    Correctness is 1.0 when ``extract_answer(response, mode)`` equals the
    normalised ``gold`` and 0.0 otherwise.  ``format_bonus`` (>= 0) is added
    whenever the response is well formed, i.e. its last ``####`` marker is
    followed by a number, even if that number is wrong.  The total can
    therefore exceed 1 (at most ``1 + format_bonus``).

    ``gold`` may be raw (``"1,234"``) or already normalised; a gold that is
    not a number raises ValueError rather than silently scoring 0.
    """
    if not (isinstance(format_bonus, (int, float)) and math.isfinite(format_bonus)):
        raise ValueError(f"format_bonus must be a finite number, got {format_bonus!r}")
    if format_bonus < 0:
        raise ValueError(f"format_bonus must be >= 0, got {format_bonus!r}")
    normalised_gold = normalize_number(gold) if isinstance(gold, str) else None
    if normalised_gold is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    predicted = extract_answer(response, mode)
    reward = 1.0 if predicted == normalised_gold else 0.0
    if format_bonus and extract_answer(response, "strict") is not None:
        reward += float(format_bonus)
    return reward


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

_DATA_SUFFIXES = (".jsonl", ".parquet")
# "name" or "namespace/name", as used for Hugging Face dataset ids.
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")
_MAX_REPORTED = 5  # how many offending rows a warning/error spells out


def load_gsm8k(
    source: str,
    split: str = "train",
    limit: int | None = None,
    config: str = "main",
) -> tuple[list[dict], int]:
    """Load GSM8K rows from a local file/directory or a Hugging Face id.

    ``source`` is resolved as follows:

    * an existing directory: ``{split}.jsonl`` or, failing that,
      ``{split}.parquet`` inside it;
    * an existing ``.jsonl`` or ``.parquet`` file: that file (``split`` is
      then ignored);
    * something that looks like a path but does not exist (it ends in
      ``.jsonl``/``.parquet``, starts with ``/``, ``.`` or ``~``, or has more
      than one ``/``): FileNotFoundError naming it;
    * otherwise a Hugging Face dataset id such as ``openai/gsm8k``, loaded
      with ``datasets.load_dataset(source, config, split=split)``.

    Returns ``(rows, skipped)``: each row is ``{"question", "answer" (the raw
    solution text), "gold" (normalised number)}``; ``skipped`` counts rows
    dropped because ``question``/``answer`` was missing or not a non-empty
    string, or because the answer has no numeric ``#### `` gold.  Skips are
    reported with a single warning naming the first few offenders; if every
    row is skipped a ValueError is raised instead.  ``limit`` caps the
    number of rows *kept* (reading stops once it is reached).

    Raises ValueError for an empty file, an invalid JSON line (naming file
    and line number) or an unsupported file type.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    source = os.fspath(source)
    expanded = os.path.expanduser(source)

    if os.path.isdir(expanded):
        path = _find_split_file(expanded, split)
        return _collect(_read_local_file(path), path, limit)
    if os.path.isfile(expanded):
        return _collect(_read_local_file(expanded), expanded, limit)
    if _looks_like_path(source) or not _HF_ID.fullmatch(source):
        raise FileNotFoundError(f"GSM8K source {source!r} does not exist")
    origin = f"{source} ({config}, {split})"
    return _collect(_read_hf_dataset(source, config, split), origin, limit)


def _looks_like_path(source: str) -> bool:
    """True when ``source`` cannot be a Hugging Face id and must be a path."""
    return (
        source.endswith(_DATA_SUFFIXES) or source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source
    )


def _find_split_file(directory: str, split: str) -> str:
    """Return ``directory/{split}.jsonl`` or ``.parquet``, whichever exists first."""
    candidates = [os.path.join(directory, split + suffix) for suffix in _DATA_SUFFIXES]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"no file for split {split!r} in {directory}: looked for " + " and ".join(candidates))


def _read_local_file(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, record)`` pairs from a .jsonl or .parquet file."""
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".parquet"):
        return _read_parquet(path)
    raise ValueError(f"unsupported GSM8K file type (expected .jsonl or .parquet): {path}")


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``("line N", record)`` for each non-blank line of a JSON-lines file."""
    seen_any = False
    with open(path, encoding="utf-8") as handle:
        try:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                seen_any = True
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {line_number}: invalid JSON ({exc.msg})") from exc
                yield f"line {line_number}", record
        except UnicodeDecodeError:  # decoded a chunk at a time: where the byte is, read from the file's bytes
            raise _not_utf8(path) from None
    if not seen_any:
        raise ValueError(f"GSM8K file is empty: {path}")


def _not_utf8(path: str) -> ValueError:
    """The refusal of a JSON-lines file that is not UTF-8 text: the file, the first bad byte, its line and offset."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return ValueError(
            f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset {exc.start}: "
            f"{exc.reason}); save the file as UTF-8"
        )
    return ValueError(f"{path}: not UTF-8 text; save the file as UTF-8")


def _parquet_not_utf8(path: str, table) -> ValueError:
    """The refusal of a parquet file whose text column holds a value that is not UTF-8: the file, row and column."""
    import pyarrow as pa

    for name in table.column_names:
        column = table.column(name)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            for index, raw in enumerate(column.cast(pa.large_binary()).to_pylist()):
                try:
                    (raw or b"").decode("utf-8")
                except UnicodeDecodeError as exc:
                    return ValueError(
                        f"{path}: row {index}, column {name!r}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                        f"byte {exc.start} of the value: {exc.reason}); write the file with UTF-8 text"
                    )
    return ValueError(f"{path}: not UTF-8 text; write the file with UTF-8 text")


def _read_parquet(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``("row N", record)`` (0-based N) for each row of a parquet file."""
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        try:
            records = table.to_pylist()
        except UnicodeDecodeError:
            raise _parquet_not_utf8(path, table) from None
    except ImportError:
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(f"reading {path} needs pyarrow or pandas: pip install pyarrow") from exc
        records = pd.read_parquet(path).to_dict("records")
    if not records:
        raise ValueError(f"GSM8K file is empty: {path}")
    for index, record in enumerate(records):
        yield f"row {index}", record


def _read_hf_dataset(source: str, config: str, split: str) -> Iterator[tuple[str, Any]]:
    """Yield ``("row N", record)`` from ``datasets.load_dataset(source, config, split=split)``."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            f"{source!r} is not a local path, so it was treated as a Hugging Face "
            "dataset id, which needs the 'datasets' package: pip install datasets"
        ) from exc
    try:
        dataset = datasets.load_dataset(source, config, split=split)
    except Exception as exc:
        exc.add_note(f"{source!r} is not an existing local path, so it was loaded as a Hugging Face dataset id")
        raise
    if len(dataset) == 0:
        raise ValueError(f"Hugging Face dataset {source!r} ({config}, {split}) is empty")
    for index, record in enumerate(dataset):
        yield f"row {index}", record


def _check_record(record: Any) -> tuple[dict | None, str]:
    """Validate one raw record; return ``(row, "")`` or ``(None, reason)``."""
    if not isinstance(record, dict):
        return None, f"not an object ({type(record).__name__})"
    for field in ("question", "answer"):
        value = record.get(field)
        if not isinstance(value, str) or not value.strip():
            problem = "missing" if value is None else f"not a non-empty string ({value!r:.40})"
            return None, f"{field!r} {problem}"
    answer = record["answer"]
    gold = parse_gold_answer(answer)
    if gold is None:
        position = answer.rfind(_MARKER)
        if position < 0:
            return None, "answer has no '#### ' marker"
        tail = answer[position:].split("\n", 1)[0]
        return None, f"answer gold {tail!r:.40} is not a number"
    return {"question": record["question"], "answer": answer, "gold": gold}, ""


def _collect(records: Iterable[tuple[str, Any]], origin: str, limit: int | None) -> tuple[list[dict], int]:
    """Validate records into rows, counting and reporting the skipped ones."""
    rows: list[dict] = []
    problems: list[str] = []
    skipped = 0
    for location, record in records:
        row, reason = _check_record(record)
        if row is None:
            skipped += 1
            if len(problems) < _MAX_REPORTED:
                problems.append(f"{location}: {reason}")
            continue
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    if skipped:
        details = "; ".join(problems) + ("; ..." if skipped > len(problems) else "")
        if not rows:
            raise ValueError(f"{origin}: all {skipped} rows were invalid and skipped ({details})")
        warnings.warn(
            f"{origin}: skipped {skipped} invalid GSM8K row(s) out of {skipped + len(rows)} read ({details})",
            stacklevel=3,
        )
    return rows, skipped


# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------


def format_prompt(question: str) -> str:
    """Return the rollout prompt for ``question``: the question, then INSTRUCTION."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    return f"{question.strip()}\n\n{INSTRUCTION}"
