"""What the docs say and what the code has, read side by side (tests/unit/test_docs.py compares them).

Docs: README.md and docs/*.md (plus deploy/prometheus and deploy/grafana for metric names). Code: the
Settings fields, the log events and metrics the code emits (read from the source with `ast`, so a
name built in a loop over literal tuples is found too), and the argparse parsers, built in-process.
No services, no torch.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])
CODE_DIRS = ("shared", "producer", "workers")
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "msg"}
EVENT_RE = re.compile(r"^MRC_[A-Z0-9_]+$")
MRC_NAME_RE = re.compile(r"(?<![A-Za-z0-9_])MRC_[A-Z0-9][A-Z0-9_]*[A-Z0-9]")
RETIRED_HEADING = "## Retired names"


@dataclass(frozen=True)
class Mention:
    """A name found in a doc: where, for the failure message."""

    name: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def mentions(pattern: re.Pattern[str], paths: list[Path], group: int = 0) -> Iterator[Mention]:
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in pattern.finditer(line):
                yield Mention(match.group(group), path, number)


def section(path: Path, heading: str) -> str:
    """The text under `heading` (a line starting with it) up to the next heading of its level or above."""
    lines = path.read_text(encoding="utf-8").splitlines()
    level = len(heading) - len(heading.lstrip("#"))
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise AssertionError(f"{rel(path)} has no section {heading!r}")
    out, in_block = [], False
    for line in lines[start + 1 :]:
        in_block ^= line.lstrip().startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not in_block and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        out.append(line)
    return "\n".join(out)


def table_rows(text: str) -> list[list[str]]:
    """Cells of each markdown table row (header and separator rows included; `\\|` is a literal bar)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
            rows.append([cell.strip() for cell in cells])
    return rows


# ---------------------------------------------------------------------------------------------- code


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def emitted_events() -> dict[str, str]:
    """MRC_ events the code logs (`log.info("MRC_X", ...)` and the like) -> where, first seen."""
    found: dict[str, str] = {}
    for path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and EVENT_RE.match(node.args[0].value)
            ):
                found.setdefault(node.args[0].value, f"{rel(path)}:{node.lineno}")
    return found


def event_keys() -> dict[str, set[str]]:
    """MRC_ events the code logs -> the keys its calls pass by name, across every call of it ("**" where
    one passes a mapping: its keys are not readable here)."""
    keys: dict[str, set[str]] = {}
    for _path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and EVENT_RE.match(node.args[0].value)
            ):
                names = {keyword.arg or "**" for keyword in node.keywords}
                keys.setdefault(node.args[0].value, set()).update(names)
    return keys


_COUNTERS = {"Counter", "CounterMetricFamily"}
_HISTOGRAMS = {"Histogram", "HistogramMetricFamily"}
_SUMMARIES = {"Summary", "SummaryMetricFamily"}
_METRIC_KINDS = _COUNTERS | _HISTOGRAMS | _SUMMARIES | {"Gauge", "GaugeMetricFamily", "Info", "Enum"}


@dataclass(frozen=True)
class Metric:
    name: str  # as scraped: counters end in _total
    kind: str
    where: str

    def samples(self) -> set[str]:
        """Every series name a query may use for it."""
        if self.kind == "histogram":
            return {self.name, *(f"{self.name}_{part}" for part in ("bucket", "sum", "count"))}
        if self.kind == "summary":
            return {self.name, f"{self.name}_sum", f"{self.name}_count"}
        return {self.name}


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _kind(call: str) -> str:
    if call in _COUNTERS:
        return "counter"
    if call in _HISTOGRAMS:
        return "histogram"
    if call in _SUMMARIES:
        return "summary"
    return "gauge"


def _loop_values(loop: ast.For, name: str) -> list[str] | None:
    """The constant strings `name` takes in `for ... in <literal tuple>`; None if it is not bound there."""
    target = loop.target
    if isinstance(target, ast.Name):
        position = None if target.id == name else -1
    elif isinstance(target, ast.Tuple):
        ids = [t.id if isinstance(t, ast.Name) else None for t in target.elts]
        position = ids.index(name) if name in ids else -1
    else:
        return None
    if position == -1 or not isinstance(loop.iter, ast.Tuple | ast.List):
        return None
    values = []
    for element in loop.iter.elts:
        item = (
            element
            if position is None
            else element.elts[position]
            if isinstance(element, ast.Tuple)
            else None
        )
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            return None
        values.append(item.value)
    return values


def _names(arg: ast.expr, loops: list[ast.For]) -> list[str] | None:
    """A metric name argument as the names it yields: a literal, or an f-string over loop variables."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if not isinstance(arg, ast.JoinedStr):
        return None
    choices: list[list[str]] = []
    for part in arg.values:
        if isinstance(part, ast.Constant):
            choices.append([str(part.value)])
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name):
            values = next((v for loop in loops if (v := _loop_values(loop, part.value.id)) is not None), None)
            if values is None:
                return None
            choices.append(values)
        else:
            return None
    return ["".join(parts) for parts in itertools.product(*choices)]


def _process_metrics(namespace: str, where: str) -> list[Metric]:
    from prometheus_client import ProcessCollector

    found = []
    for family in ProcessCollector(namespace=namespace, registry=None).collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        found.append(Metric(name, family.type, where))
    return found


def _declared(node: ast.Call, loops: list[ast.For], where: str) -> list[Metric] | None:
    """The metrics one call declares ([] for a call that declares none); None when a metric's name
    cannot be read from the source."""
    call = _call_name(node)
    if call == "ProcessCollector":
        namespace = next((k.value for k in node.keywords if k.arg == "namespace"), None)
        if isinstance(namespace, ast.Constant) and isinstance(namespace.value, str):
            return _process_metrics(namespace.value, where)
        return None
    if call not in _METRIC_KINDS or not node.args:
        return []
    names = _names(node.args[0], loops)
    if names is None:
        return None
    kind = _kind(call)
    # prometheus_client exposes a counter as NAME_total whether or not NAME ends with it
    suffix = "_total" if kind == "counter" else ""
    return [Metric(name.removesuffix(suffix) + suffix, kind, where) for name in names]


def emitted_metrics() -> tuple[dict[str, Metric], list[str]]:
    """Metrics the code declares -> Metric; and the declarations whose name cannot be read statically."""
    found: dict[str, Metric] = {}
    unreadable: list[str] = []

    def visit(node: ast.AST, loops: list[ast.For], path: Path) -> None:
        if isinstance(node, ast.For):
            loops = [node, *loops]
        if isinstance(node, ast.Call):
            where = f"{rel(path)}:{node.lineno}"
            metrics = _declared(node, loops, where)
            if metrics is None:
                unreadable.append(where)
            for metric in metrics or ():
                found.setdefault(metric.name, metric)
        for child in ast.iter_child_nodes(node):
            visit(child, loops, path)

    for path, tree in _sources():
        visit(tree, [], path)
    return found, unreadable


def settings_fields() -> dict[str, object]:
    """MRC_ name -> its real default."""
    from shared.settings import ENV_PREFIX, Settings

    return {
        ENV_PREFIX + name.upper(): field.get_default(call_default_factory=True)
        for name, field in Settings.model_fields.items()
    }


def attribute_reads(attribute: str) -> list[str]:
    """Where the code reads `<something>.<attribute>`, shared/settings.py apart."""
    out = []
    for path, tree in _sources():
        if rel(path) == "shared/settings.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == attribute:
                out.append(f"{rel(path)}:{node.lineno}")
    return out


def exit_constants(module: str) -> dict[str, int]:
    """A module's EXIT_* constants, by name."""
    import importlib

    loaded = importlib.import_module(module)
    return {k: v for k, v in vars(loaded).items() if k.startswith("EXIT_") and isinstance(v, int)}


# ----------------------------------------------------------------------------------------------- CLI


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each console script's parser, built in-process (pyproject.toml's [project.scripts])."""
    from producer import api_cli, cli
    from workers import cli as worker_cli

    return {
        "mrc": cli._parser(),
        "mrc-worker": worker_cli._parser(),
        "mrc-api": api_cli._parser(),  # its settings come from the environment only
    }


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    flags = {flag for action in parser._actions for flag in action.option_strings}
    return {flag for flag in flags if flag.startswith("--") and flag != "--help"}


def commands() -> dict[str, set[str]]:
    """'mrc submit', 'mrc dlq', 'mrc-worker', ... -> the long options it takes (a command's nested
    subcommands, like `mrc dlq list`, share one entry: the union of their options)."""
    out: dict[str, set[str]] = {}
    for program, parser in parsers().items():
        subs = _subparsers(parser)
        if not subs:
            out[program] = _options(parser)
        for name, sub in subs.items():
            nested = _subparsers(sub)
            out[f"{program} {name}"] = _options(sub).union(*(_options(n) for n in nested.values()))
    return out


_PROGRAM = re.compile(r"(?<![\w./-])(?:\.venv/bin/)?(mrc-worker|mrc-api|mrc)(?=\s|$)")
_SEPARATOR = re.compile(r"\s(?:\||&&|;|>>?|2>&1)\s|\s#|;")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_WORD = re.compile(r"\s+([a-z][\w|-]*)")


def _segments(path: Path) -> Iterator[tuple[int, str]]:
    """Command-like text: each line of a fenced code block (continuations joined) and each inline
    code span elsewhere, with its line number."""
    in_block, pending, start = False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            if not pending:
                start = number
            pending += line.rstrip("\\") + " "
            if not line.endswith("\\"):
                yield start, pending
                pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span


def _starts_a_command(before: str) -> bool:
    """Whether a program name after `before` is run (`mrc ...`, `X=1 mrc ...`, `a | mrc ...`), not an
    argument of something else (`docker compose -p mrc ...`)."""
    words = before.split()
    if not words:
        return True
    last = words[-1]
    return "=" in last or last in {"|", "&&", ";", "sudo", "exec"} or last.endswith((")", ";"))


@dataclass(frozen=True)
class Invocation:
    command: str  # 'mrc submit', 'mrc-worker', or 'mrc' alone
    flags: tuple[str, ...]
    path: Path
    line: int

    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def invocations(paths: list[Path]) -> Iterator[Invocation]:
    """Every `mrc ...`, `mrc-worker ...`, `mrc-api ...` written in the docs, with the options it shows.
    `mrc dlq list|requeue|purge` is one invocation of `mrc dlq`; `mrc submit|status` one of each."""
    for path in paths:
        for line, text in _segments(path):
            for match in _PROGRAM.finditer(text):
                if not _starts_a_command(text[: match.start()]):
                    continue
                program, rest = match.group(1), text[match.end() :]
                # `[--json-schema F | --choice A,B]` is one usage alternative, not a pipe
                rest = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace("|", "/"), rest)
                stop = _SEPARATOR.search(rest)
                rest = rest[: stop.start()] if stop else rest
                flags = tuple(_FLAG.findall(rest))
                word = _WORD.match(rest) if program == "mrc" else None
                if word is None:
                    yield Invocation(program, flags, path, line)
                    continue
                for name in word.group(1).split("|"):
                    yield Invocation(f"mrc {name}", flags, path, line)


# ------------------------------------------------------------------------------------------- figures

# A figure: a number with a unit of time (ms, s), a ratio (×), a share (%) or a rate (…/s); a range
# ("0.32–0.40 s") gives both ends that unit. "1080×1920" (a size) and "8 × 33 MiB" (arithmetic) are
# not ratios: a × followed by a digit is a product.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE_RE = re.compile(
    rf"(?<![\w.,/-])(?:(?P<low>{_NUMBER})\s?[–-]\s?)?(?P<value>{_NUMBER})\s?"
    r"(?P<unit>ms\b|s\b|×(?!\s?\d)|%|(?:jobs|tokens|lines|requests|img|images)/s\b)"
)


def figures(text: str) -> Iterator[tuple[str, str]]:
    """(number, unit) for each figure in `text`, numbers without thousands separators."""
    for match in FIGURE_RE.finditer(text):
        unit = match.group("unit")
        for number in (match.group("low"), match.group("value")):
            if number:
                yield number.replace(",", ""), unit


def code_constants() -> set[str]:
    """Every number written in the code, the deployment files and the settings' defaults (as text,
    and ×100 for a fraction that a doc may give as a percentage): a doc figure equal to one of these
    states a configured constant, not a measurement."""
    numbers: set[float] = set()
    for _path, tree in _sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, int | float)
                and not isinstance(node.value, bool)
            ):
                numbers.add(float(node.value))
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".conf", ".json", ""}:
            numbers.update(
                float(n)
                for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", path.read_text(errors="replace"))
            )
    for value in settings_fields().values():
        if isinstance(value, int | float) and not isinstance(value, bool):
            numbers.add(float(value))
    numbers |= {round(n * 100, 6) for n in numbers if 0 < n < 1}
    return {_plain(n) for n in numbers}


def _plain(number: float) -> str:
    return str(int(number)) if number == int(number) else repr(number)


def plain(text: str) -> str:
    return _plain(float(text))
