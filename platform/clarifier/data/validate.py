"""Validate one input line: an evaluation-set Example or a ConversationLog. Pure, never raises.

    examples, quarantine = parse_line(raw_line, source="logs/part-0.jsonl", line_no=17)

A good line gives ``(examples, None)`` (a conversation log gives one Example per labelled user
turn). A bad line gives ``([], record)`` with ``record = {"source", "line", "reason", "raw"}``; the
reason names the field (``"turns[3].text has 5012 chars (> max_turn_chars=4000)"``) and ``raw`` is
the (truncated) line as text. Line numbers are 1-based.

Which shape a record is: it is a ConversationLog when it has ``turns``; otherwise an Example (the
evaluation-set format of ``../shared/README.md``); an object with none of ``turns``, ``query``,
``history``, ``needs_clarification`` is reported as neither.

:func:`parse_line_full` / :func:`check_object` (a decoded record, e.g. a Parquet row) also take
the ``data.labelling`` rules: with them enabled, a conversation log without any label is labelled
by :mod:`clarifier.data.labelling` and the user turns it filtered are returned as a third value.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

from clarifier.core.config import DataConfig, LabellingConfig
from clarifier.core.schema import ConversationLog, Example, describe_validation_error
from clarifier.data.labelling import FilteredTurn, label_conversation

RAW_LIMIT = 2000  # characters of the raw line kept in a quarantine record
ROLES = ("user", "assistant", "system")
DEFAULT_MAX_TURN_CHARS = DataConfig.model_fields["max_turn_chars"].default

_EXAMPLE_KEYS = ("query", "history", "needs_clarification")


def _raw_text(line: str | bytes) -> str:
    if isinstance(line, (bytes, bytearray)):
        text = bytes(line).decode("utf-8", errors="replace")
    else:
        text = str(line)
    text = text.rstrip("\r\n")
    return text if len(text) <= RAW_LIMIT else text[:RAW_LIMIT] + f"... [{len(text)} chars]"


def quarantine_record(source: str, line_no: int, reason: str, raw: str | bytes) -> dict:
    return {"source": source, "line": int(line_no), "reason": reason, "raw": _raw_text(raw)}


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), type(v).__name__)


def _describe(exc: Exception) -> str:
    return describe_validation_error(exc).replace("Value error, ", "")


def _check_turns(turns: Any, field: str, max_chars: int) -> str | None:
    """Roles and sizes of a list of turns; ``None`` when fine or when pydantic will say it better."""
    if not isinstance(turns, list):
        return None
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return f"{field}[{i}] must be an object with role and text (got {_type_name(t)})"
        role = t.get("role")
        if isinstance(role, str) and role not in ROLES:
            return f"{field}[{i}].role {role!r} is not one of {'/'.join(ROLES)}"
        text = t.get("text")
        if isinstance(text, str) and len(text) > max_chars:
            return f"{field}[{i}].text has {len(text)} chars (> max_turn_chars={max_chars})"
    return None


def check_record(obj: Any, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS) -> tuple[list[Example], str | None]:
    """Validate a decoded JSON value: ``(examples, None)`` or ``([], reason)``."""
    examples, reason, _ = check_record_full(obj, max_turn_chars)
    return examples, reason


def check_record_full(
    obj: Any, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS, labelling: LabellingConfig | None = None
) -> tuple[list[Example], str | None, list[FilteredTurn]]:
    """Like :func:`check_record`, plus the user turns the labelling rules filtered.

    With ``labelling.enabled``, a conversation log without any gold label is labelled by
    :func:`clarifier.data.labelling.label_conversation`; one that gives no example at all is
    reported (quarantined) with the filter reason of each user turn. Logs with gold labels and
    evaluation-set examples are unaffected.
    """
    if not isinstance(obj, dict):
        return [], f"record is not a JSON object (got {_type_name(obj)})", []
    if "turns" in obj:
        problem = _check_turns(obj.get("turns"), "turns", max_turn_chars)
        if problem:
            return [], problem, []
        try:
            log = ConversationLog.model_validate(obj)
        except ValueError as exc:
            return [], _describe(exc), []
        try:
            examples = log.explode()
        except ValueError as exc:
            return [], str(exc).replace("Value error, ", ""), []
        if not examples and labelling is not None and labelling.enabled:
            try:
                res = label_conversation(log, labelling)
            except ValueError as exc:
                return [], f"labelling rules: {_describe(exc)}", []
            if not res.examples:
                why = ", ".join(f"turn {f.turn_index} {f.reason}" for f in res.filtered) or "it has no user turn"
                return [], f"unlabelled conversation gives no example under data.labelling rules ({why})", []
            return res.examples, None, res.filtered
        if not examples:
            return [], ("conversation has no labelled user turns (nothing to learn from; "
                        "data.labelling.enabled=true labels such logs by rules)"), []
        return examples, None, []
    if not any(k in obj for k in _EXAMPLE_KEYS):
        keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
        return [], f"record has neither 'query' (evaluation-set example) nor 'turns' (conversation log); keys: {keys}", []
    problem = _check_turns(obj.get("history"), "history", max_turn_chars)
    if problem:
        return [], problem, []
    q = obj.get("query")
    if isinstance(q, str) and len(q) > max_turn_chars:
        return [], f"query has {len(q)} chars (> max_turn_chars={max_turn_chars})", []
    try:
        return [Example.model_validate(obj)], None, []
    except ValueError as exc:
        return [], _describe(exc), []


def parse_line(
    line: str | bytes, source: str, line_no: int, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS
) -> tuple[list[Example], dict | None]:
    """Parse and validate one JSONL line. Never raises; see the module docstring."""
    examples, q, _ = parse_line_full(line, source, line_no, max_turn_chars)
    return examples, q


def decode_line(line: str | bytes, source: str, line_no: int) -> tuple[Any, dict | None]:
    """One JSONL line as a JSON value: ``(value, None)``, or ``(None, quarantine record)`` for invalid
    UTF-8, an empty line or bad JSON (a UTF-8 BOM is ignored). Never raises."""
    if isinstance(line, (bytes, bytearray)):
        try:
            text = bytes(line).decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, quarantine_record(source, line_no, f"invalid UTF-8 at byte {exc.start}: {exc.reason}", line)
    else:
        text = line
    text = text.lstrip("\ufeff")  # a UTF-8 BOM on the first line
    if not text.strip():
        return None, quarantine_record(source, line_no, "empty line", line)
    try:
        return json.loads(text), None
    except (json.JSONDecodeError, RecursionError) as exc:
        msg = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return None, quarantine_record(source, line_no, f"bad JSON: {msg}", line)


def parse_line_full(
    line: str | bytes, source: str, line_no: int, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS,
    labelling: LabellingConfig | None = None,
) -> tuple[list[Example], dict | None, list[FilteredTurn]]:
    """:func:`parse_line` plus labelling of unlabelled logs (see :func:`check_record_full`). Never raises."""
    try:
        obj, q = decode_line(line, source, line_no)
        if q is not None:
            return [], q, []
        return check_object(obj, source, line_no, line, max_turn_chars, labelling)
    except Exception as exc:  # defensive: a validator bug must not abort a data job
        return [], quarantine_record(source, line_no, f"unexpected validation error: {type(exc).__name__}: {exc}", line), []


def check_object(
    obj: Any, source: str, line_no: int, raw: str | bytes, max_turn_chars: int = DEFAULT_MAX_TURN_CHARS,
    labelling: LabellingConfig | None = None,
) -> tuple[list[Example], dict | None, list[FilteredTurn]]:
    """A decoded record (a JSONL line or a Parquet row): ``(examples, quarantine record or None, filtered turns)``."""
    try:
        examples, reason, filtered = check_record_full(obj, max_turn_chars, labelling)
    except Exception as exc:  # defensive, as in parse_line_full
        reason, filtered = f"unexpected validation error: {type(exc).__name__}: {exc}", []
    if reason is not None:
        return [], quarantine_record(source, line_no, reason, raw), []
    return examples, None, filtered


class UnreadableFile(ValueError):
    """A ``.gz`` file that does not decompress (not gzip, truncated); the message says so."""


def read_lines(filesystem, path: str) -> list[bytes]:
    """The lines of a JSONL file, gunzipped when its name ends in ``.gz`` (:class:`UnreadableFile` when that fails)."""
    data = read_file(filesystem, path)
    if path.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, ValueError, zlib.error) as exc:  # not gzip / truncated
            raise UnreadableFile(f"cannot decompress gzip file: {exc}") from None
    return split_lines(data)


def split_lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def read_file(filesystem, path: str) -> bytes:
    # compression=None: the raw bytes (pyarrow would otherwise guess from the suffix); .gz is
    # decompressed by the caller so that a corrupt file is quarantined instead of failing the job.
    with filesystem.open_input_stream(path, compression=None) as f:
        return f.readall()
