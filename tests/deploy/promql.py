"""The metric names Sluice exports, and the metric names a PromQL expression reads.

Why: a dashboard panel or alert on a misspelled metric is not an error anywhere, it is an empty graph or
an alert that never fires. Every expression in deploy/ must read only metrics listed here (or series
recorded by our own rules); a renamed metric then fails a test instead of going quiet.

The extraction is deliberately simple (regular expressions, not a PromQL parser): strings, label
matchers, range selectors and grouping clauses are blanked out, and every remaining identifier that is not
a keyword or a function call is a metric name.
"""

from __future__ import annotations

import re


def _exported() -> dict[str, str]:
    """name -> Prometheus type, read from the router's and the worker's own metric registries (so this
    list cannot drift from the code). Counters are exported with their `_total` suffix; histograms are
    read through their _bucket/_sum/_count series."""
    from sluice_inference.router.metrics import RouterMetrics
    from sluice_inference.worker.metrics import WorkerMetrics

    found: dict[str, str] = {}
    for registry in (RouterMetrics().registry, WorkerMetrics().registry):
        for family in registry.collect():
            name = family.name + "_total" if family.type == "counter" else family.name
            found[name] = family.type
    return found


METRICS = _exported()
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# An identifier not glued to a preceding word character, `$` (a Grafana variable) or `.` (a number).
_IDENTIFIER = re.compile(r"(?<![\w$.:])[A-Za-z_:][\w:]*")
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless"}
    | {"inf", "nan", "start", "end"}
)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name = match.group()
        if name.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(name)
    return names


def known_series(recorded: frozenset[str] = frozenset()) -> set[str]:
    """Every series name an expression may select: exported metrics (histograms by their series) and
    the names our own recording rules produce."""
    series = set(recorded)
    for name, kind in METRICS.items():
        if kind == "histogram":
            series.update(name + suffix for suffix in HISTOGRAM_SERIES)
        else:
            series.add(name)
    return series


def unknown_metrics(expr: str, recorded: frozenset[str] = frozenset()) -> set[str]:
    """Names the expression selects that Sluice does not export (empty: all known)."""
    return metric_names(expr) - known_series(recorded)
