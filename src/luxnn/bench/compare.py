"""``luxnn compare BASE.json NEW.json``: the tables of two runs, AirspeedVelocity's way.

Time: ``| name | base | new | base / new |``, each cell the median ± IQR of the round
medians, the ratio with its propagated error; a ratio above 1 means NEW is faster, and a
ratio that differs from 1 by more than its error and by more than 5 % is marked "faster"
or "slower". Memory: NumPy allocations and bytes per call (``N allocs: X kB``) and the
plain ratio of the bytes; then the peaks (live / reserved) and the upstream allocations per
call. ``time_to_load`` comes last. Rows only one run has are shown with "—".
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from . import BenchError
from .runner import FORMAT, SCHEMA
from .stats import (
    format_allocs, format_bytes, format_count, format_ratio, format_time, ratio, significance, significant, summarize,
)  # fmt: skip
from .suite import TIME_TO_LOAD

MISSING = "—"


# ---- reading results -------------------------------------------------------------------


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_row(path: str, index: int, row: Any) -> None:
    def bad(why: str) -> BenchError:
        return BenchError(f"{path}: malformed result, row {index}: {why}")

    if not isinstance(row, dict) or not isinstance(row.get("name"), str):
        raise bad("expected an object with a 'name'")
    times = row.get("times")
    if not isinstance(times, list) or not all(isinstance(r, list) and all(_number(x) and x > 0 for x in r) for r in times):
        raise bad(f"{row['name']!r}: 'times' must be a list of rounds, each a list of positive seconds")
    if not row.get("error") and not any(times):
        raise bad(f"{row['name']!r}: no samples and no error")
    mem = row.get("memory")
    if mem is not None and not isinstance(mem, dict):
        raise bad(f"{row['name']!r}: 'memory' must be an object or null")
    if mem and "error" not in mem and mem.get("bytes") is not None:
        counts = {key: mem.get(key) for key in ("allocs", "bytes", "peak_live", "upstream_allocs")}
        if not all(_number(x) and x >= 0 for x in counts.values()) or not (mem.get("peak_reserved") is None or _number(mem["peak_reserved"])):
            raise bad(f"{row['name']!r}: 'memory' must hold non-negative numbers {sorted(counts)} and 'peak_reserved' (a number or null)")


def _check_header(path: str, doc: dict[str, Any]) -> None:
    """The fields that the tables' header lines read."""
    def bad(why: str) -> BenchError:
        return BenchError(f"{path}: malformed result: {why}")

    for key in ("machine", "versions"):
        if key in doc and not isinstance(doc[key], dict):
            raise bad(f"{key!r} must be an object, got {type(doc[key]).__name__}")
    for key in ("load_average", "load_average_end"):
        load = doc.get("machine", {}).get(key)
        if load is not None and not (isinstance(load, list) and all(_number(x) for x in load)):
            raise bad(f"'machine' {key!r} must be a list of numbers")
    if not isinstance(doc.get("environment") or {}, dict):
        raise bad("'environment' must be an object or null")
    blas = doc.get("blas") or []
    if not (isinstance(blas, list) and all(isinstance(p, dict) for p in blas)):
        raise bad("'blas' must be a list of objects or null")


def load(path: str) -> dict[str, Any]:
    """A result document written by ``luxnn bench --json``, checked."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise BenchError(f"{path}: no such file") from None
    except OSError as e:
        raise BenchError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise BenchError(f"{path}: not a luxnn bench result (not UTF-8 text: byte {e.start} is {e.object[e.start]:#04x})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an over-long integer, or nesting deeper than Python's stack
        raise BenchError(f"{path}: not a luxnn bench result ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BenchError(f"{path}: not a luxnn bench result (no \"format\": \"{FORMAT}\"); write one with `luxnn bench --json PATH`")
    if doc.get("schema") != SCHEMA:
        raise BenchError(f"{path}: result schema {doc.get('schema')!r}, this luxnn reads schema {SCHEMA}")
    if doc.get("suite") not in ("quick", "full"):
        raise BenchError(f"{path}: malformed result: 'suite' must be \"quick\" or \"full\", got {doc.get('suite')!r}")
    _check_header(path, doc)
    rows = doc.get("rows")
    if not isinstance(rows, list):
        raise BenchError(f"{path}: malformed result: 'rows' must be a list")
    for i, row in enumerate(rows):
        _check_row(path, i, row)
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        raise BenchError(f"{path}: malformed result: a row name appears twice")
    return doc


def check_comparable(base: dict[str, Any], new: dict[str, Any], base_name: str = "BASE", new_name: str = "NEW") -> None:
    """Results of different suites (quick and full sizes), or with no row in common, do
    not compare."""
    if base["suite"] != new["suite"]:
        raise BenchError(
            f"results of different suites: {base_name} is from the {base['suite']} suite, {new_name} from the "
            f"{new['suite']} suite; compare two runs both with or both without --quick"
        )
    common = {r["name"] for r in base["rows"]} & {r["name"] for r in new["rows"]}
    if not common:
        raise BenchError(f"{base_name} and {new_name} have no row in common (were they run with different --filter?)")


# ---- tables ---------------------------------------------------------------------------


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A pipe table: GitHub markdown (name left, the rest centred) or padded plain text."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|:---|" + "|".join([":---:"] * (len(headers) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.center(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def header_lines(runs: Sequence[tuple[str, dict[str, Any]]], markdown: bool) -> list[str]:
    """Who was measured where: label, date, CPU, BLAS, load, for each run."""
    from .machine import blas_summary

    out = []
    for role, doc in runs:
        m, v = doc.get("machine", {}), doc.get("versions", {})
        load = m.get("load_average")
        load_end = m.get("load_average_end")
        loads = f", load {load[0]:.2f} → {load_end[0]:.2f}" if load and load_end else ""
        torch = f", torch {v['torch']} ({v.get('torch_threads')} threads)" if "torch" in v else ""
        env = doc.get("environment") or {}
        env_text = (", " + ", ".join(f"{k}={val}" for k, val in env.items())) if env else ""
        text = (
            f"{role}: {doc.get('label', '?')} ({doc['suite']} suite, {doc.get('created', '?')}) on {m.get('cpu', '?')}, "
            f"{m.get('cpus_usable', '?')} CPUs{loads}; luxnn threads {v.get('luxnn_threads', '?')}, numpy {v.get('numpy', '?')}, "
            f"BLAS {blas_summary(doc.get('blas') or [])}{torch}{env_text}"
        )
        out.append(f"- {text}" if markdown else text)
    return out


def _ordered_names(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    names = [r["name"] for r in base["rows"]]
    names += [r["name"] for r in new["rows"] if r["name"] not in names]
    return [n for n in names if n != TIME_TO_LOAD] + [n for n in names if n == TIME_TO_LOAD]


def _time(row: dict[str, Any] | None) -> tuple[float, float] | None:
    if row is None or row.get("error") or not any(row["times"]):
        return None
    return summarize(row["times"])


def _time_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return MISSING
    if row.get("error"):
        return "error"
    return format_time(*summarize(row["times"]))


def _memory(row: dict[str, Any] | None) -> dict[str, Any] | None:
    m = row.get("memory") if row else None
    if not m or "error" in m or m.get("bytes") is None:
        return None
    return m


def time_rows(base: dict[str, Any], new: dict[str, Any], markdown: bool) -> list[list[str]]:
    b_rows, n_rows = ({r["name"]: r for r in d["rows"]} for d in (base, new))
    out = []
    for name in _ordered_names(base, new):
        b, n = b_rows.get(name), n_rows.get(name)
        tb, tn = _time(b), _time(n)
        cell = MISSING
        if tb and tn:
            r, err = ratio(*tb, *tn)
            cell = format_ratio(r, err)
            mark = significance(r, err)
            if mark:
                cell = f"**{cell}** {mark}" if markdown else f"{cell} {mark}"
        out.append([name, _time_cell(b), _time_cell(n), cell])
    return out


def _memory_cell(raw: dict[str, Any] | None, fmt: Any) -> str:
    if raw and "error" in raw:
        return "error"
    return fmt(raw) if raw and raw.get("bytes") is not None else MISSING


def _allocs(m: dict[str, Any]) -> str:
    return format_allocs(m["allocs"], m["bytes"])


def _peaks(m: dict[str, Any]) -> str:
    reserved = MISSING if m.get("peak_reserved") is None else format_bytes(m["peak_reserved"])
    ratios = ""  # where the document has the all-time peaks (the cache on)
    if m.get("peak_reserved") and m["peak_live"] and m.get("all_time_peak_reserved") and m.get("all_time_peak_live"):
        steady, all_time = m["peak_reserved"] / m["peak_live"], m["all_time_peak_reserved"] / m["all_time_peak_live"]
        ratios = f" ({significant(steady, 3)}x; all-time {significant(all_time, 3)}x)"
    return f"{format_bytes(m['peak_live'])} / {reserved}{ratios}, {format_count(m['upstream_allocs'])} upstream"


def memory_rows(base: dict[str, Any], new: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """(allocations and bytes per call, peaks and upstream allocations) rows."""
    b_rows, n_rows = ({r["name"]: r for r in d["rows"]} for d in (base, new))
    per_call, peaks = [], []
    for name in _ordered_names(base, new):
        rb, rn = ((r or {}).get("memory") for r in (b_rows.get(name), n_rows.get(name)))
        if not (_counted_on_the_host(rb) or _counted_on_the_host(rn)):
            continue
        mb, mn = _memory(b_rows.get(name)), _memory(n_rows.get(name))
        per_call.append([name, _memory_cell(rb, _allocs), _memory_cell(rn, _allocs), _plain_ratio(mb, mn, "bytes")])
        peaks.append([name, _memory_cell(rb, _peaks), _memory_cell(rn, _peaks), _plain_ratio(mb, mn, "peak_live")])
    return per_call, peaks


def _counted_on_the_host(m: dict[str, Any] | None) -> bool:
    """Whether a row's memory figures are the host allocations' (a GPU row's are not)."""
    return bool(m) and ("error" in m or "allocs" in m)


def _plain_ratio(mb: dict[str, Any] | None, mn: dict[str, Any] | None, key: str) -> str:
    if not mb or not mn:
        return MISSING
    a, b = mb[key], mn[key]
    if b == 0:
        return "1" if a == 0 else "∞"
    return significant(a / b, 3)


def compare(base: dict[str, Any], new: dict[str, Any], *, markdown: bool = False) -> str:
    """The time, memory and peak tables of two result documents."""
    out = header_lines([("base", base), ("new", new)], markdown)
    heading = (lambda s: f"### {s}") if markdown else (lambda s: s)
    headers = ["name", "base", "new", "base / new"]
    out += ["", heading("Time (median ± IQR of round medians; base / new above 1: new is faster)"), ""]
    out.append(render_table(headers, time_rows(base, new, markdown), markdown))
    per_call, peaks = memory_rows(base, new)
    if per_call:
        out += ["", heading("Memory: NumPy allocations and bytes per call (base / new: bytes)"), ""]
        out.append(render_table(headers, per_call, markdown))
        out += ["", heading("Peak memory once warm: live / reserved bytes (reserved / live; all-time, warm-up included), upstream allocations per call (base / new: live)"), ""]
        out.append(render_table(headers, peaks, markdown))
    return "\n".join(out)


def compare_files(base_path: str, new_path: str, *, markdown: bool = False) -> str:
    base, new = load(base_path), load(new_path)
    check_comparable(base, new, base_path, new_path)
    return compare(base, new, markdown=markdown)
