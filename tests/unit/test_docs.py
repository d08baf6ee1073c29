"""The docs tell the truth about the code: every name, path, option, exit code and measured figure they
state is checked against the code here, and everything the code offers is documented.

Where a check fails, its message names the thing and where to fix it. README.md is the reference:
the settings table (`### Settings`), the exit-code table (`### Exit codes`), the log events and
metrics (`### Logs and metrics`), and a usage line for every command and option.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import doc_facts as facts

ROOT = facts.ROOT
README = facts.README
MEASUREMENT_PAGES = (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "scaling.md")
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_])mrc_[a-z0-9_]*[a-z0-9*]")
PATH_RE = re.compile(r"(?<![\w./$<>-])((?:shared|producer|workers|deploy|tests|scripts|docs)/[\w./*-]*)")
DEPLOY_QUERIES = sorted((ROOT / "deploy" / "prometheus").glob("*.yml")) + sorted(
    (ROOT / "deploy" / "grafana").rglob("*.json")
)


def _retired() -> set[str]:
    """Names the docs may still mention though the code no longer has them (design.md keeps the list)."""
    rows = facts.table_rows(facts.section(ROOT / "docs" / "design.md", facts.RETIRED_HEADING))
    return {name for cells in rows for name in facts.MRC_NAME_RE.findall(cells[0])}


def _fail(problems: list[str], header: str) -> None:
    if problems:
        pytest.fail(header + "\n  " + "\n  ".join(problems), pytrace=False)


# --------------------------------------------------------------------------- settings and log events


def test_every_mrc_name_in_the_docs_is_a_setting_or_an_emitted_event() -> None:
    known = set(facts.settings_fields()) | set(facts.emitted_events()) | _retired()
    problems = [
        f"{m.where()}: {m.name} is neither a setting (a field of shared/settings.py:Settings) nor a log "
        f"event the code emits; fix the name, or list it under '{facts.RETIRED_HEADING}' in docs/design.md"
        for m in facts.mentions(facts.MRC_NAME_RE, facts.DOCS)
        if m.name not in known
    ]
    _fail(problems, "The docs name MRC_ variables or events the code does not have:")


def test_every_mrc_name_in_the_deploy_files_is_a_setting() -> None:
    fields = facts.settings_fields()
    files = [p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file() and p.suffix != ".json"]
    problems = [
        f"{m.where()}: {m.name} is not a setting (shared/settings.py): the deployment would set nothing"
        for m in facts.mentions(facts.MRC_NAME_RE, files)
        if m.name not in fields
    ]
    assert files, "no deploy files found"
    _fail(problems, "deploy/ sets MRC_ variables that are no settings:")


def _readme_settings() -> dict[str, tuple[str | None, str]]:
    """MRC_ name -> (its default as README's settings table writes it, the row's meaning)."""
    out: dict[str, tuple[str | None, str]] = {}
    for cells in facts.table_rows(facts.section(README, "### Settings")):
        names = facts.MRC_NAME_RE.findall(cells[0])
        if not names or len(cells) < 3:
            continue
        written = re.findall(r"`([^`]*)`", cells[-1])
        if cells[-1].startswith("empty"):
            written = [""] * len(names)
        for i, name in enumerate(names):
            out[name] = (written[i] if len(written) == len(names) else None, cells[1])
    return out


def _same_default(written: str, real: object) -> bool:
    if isinstance(real, bool):
        return written.lower() == str(real).lower()
    if isinstance(real, int | float):
        try:
            return float(written.replace(",", "").replace("_", "")) == float(real)
        except ValueError:
            return False
    if isinstance(real, list):
        return written == "[]" and real == []
    return str(real) in (written, str(Path(written).expanduser()))


def test_every_setting_is_in_the_readme_table_with_its_real_default() -> None:
    table, problems = _readme_settings(), []
    for name, real in facts.settings_fields().items():
        if name not in table:
            problems.append(
                f"{name} (shared/settings.py) has no row in README.md's '### Settings' table: add "
                f"| `{name}` | what it does | `{real}` |"
            )
        elif table[name][0] is None:
            problems.append(f"{name}: README.md's settings row gives no default (or one per name it lists)")
        elif not _same_default(table[name][0] or "", real):
            problems.append(f"{name}: README.md says default `{table[name][0]}`, the code's is {real!r}")
    for name in set(table) - set(facts.settings_fields()):
        problems.append(f"{name}: a row in README.md's settings table, but no field of Settings")
    _fail(problems, "README.md's settings table and shared/settings.py disagree:")


def test_retired_names_are_gone_from_the_code_and_marked_where_still_accepted() -> None:
    fields, events, table = facts.settings_fields(), facts.emitted_events(), _readme_settings()
    problems = []
    for name in sorted(_retired()):
        if name in events:
            problems.append(
                f"{name} is listed as retired in docs/design.md but still logged at {events[name]}"
            )
        if name in fields:
            reads = facts.attribute_reads(name.removeprefix("MRC_").lower())
            if reads:
                problems.append(f"{name} is listed as retired (accepted, ignored) but is read at {reads[0]}")
            if "ignored" not in table.get(name, (None, ""))[1]:
                problems.append(f"{name}: README.md's settings row must say it is accepted and ignored")
    _fail(problems, "The retired names (docs/design.md) are not retired:")


def test_every_emitted_log_event_is_in_the_readme() -> None:
    documented = facts.section(README, "### Logs and metrics")
    problems = [
        f"{event} (logged at {where}) is not in README.md's '### Logs and metrics' events table: add a row "
        "with its keys and when it is logged"
        for event, where in sorted(facts.emitted_events().items())
        if not re.search(rf"`{event}`", documented)
    ]
    _fail(problems, "Log events the code emits that README.md does not document:")


def test_the_readme_names_each_events_keys_as_the_code_logs_them() -> None:
    """Review, helper-124: a key renamed in the code (`kv_ceiling`, now `row_ceiling`) stayed in the
    table, and keys added later (`backlog_share`, `request_id`, ...) were never in it: a filter on the
    table's names found nothing. A row may name a key's values in parentheses (`reason` (`cancelled`,
    `expired`)) and a key logged only at times there too (`sent`): those are not taken as stale."""
    rows = facts.table_rows(facts.section(README, "### Logs and metrics"))
    logged = facts.event_keys()
    problems = []
    for cells in rows:
        events = re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[0])
        if len(events) != 1 or events[0] not in logged or len(cells) < 3:
            continue  # a row of two events (Celery's notices and the libraries' lines) or a heading
        event = events[0]
        shown = set(re.findall(r"`([a-z][a-z0-9_]*)`", cells[1]))
        always = set(re.findall(r"`([a-z][a-z0-9_]*)`", re.sub(r"\([^)]*\)", "", cells[1])))
        keys = logged[event] - {"**", "exc_info", "stack_info"}
        if missing := sorted(keys - shown):
            problems.append(f"{event}: the code logs {missing}, its row does not name them")
        if (stale := sorted(always - keys)) and "**" not in logged[event]:
            problems.append(f"{event}: its row names {stale}, which no call of it logs")
    _fail(problems, "README.md's events table and the keys the code logs differ:")


# --------------------------------------------------------------------------------------------- metrics


def _emitted_metrics() -> dict[str, facts.Metric]:
    metrics, unreadable = facts.emitted_metrics()
    assert not unreadable, f"metric names not readable from the source (use a literal name): {unreadable}"
    assert len(metrics) >= 40, "the metric declarations were not found: is tests/support/doc_facts.py stale?"
    return metrics


def test_every_metric_named_in_the_docs_and_deploy_files_is_emitted() -> None:
    metrics = _emitted_metrics()
    series = {sample: metric for metric in metrics.values() for sample in metric.samples()}
    problems = []
    for mention in facts.mentions(METRIC_RE, [*facts.DOCS, *DEPLOY_QUERIES]):
        name = mention.name
        if name.endswith("*"):
            if not any(s.startswith(name[:-1]) for s in series):
                problems.append(f"{mention.where()}: {name} matches no metric the code emits")
        elif name not in series:
            hint = f" (a counter: {name}_total)" if f"{name}_total" in series else ""
            problems.append(f"{mention.where()}: {name} is not a metric the code emits{hint}")
    _fail(problems, "Metric names in the docs or deploy/ that no code emits:")


def test_every_emitted_metric_is_in_the_readme() -> None:
    documented = facts.section(README, "### Logs and metrics")
    globs = [g[:-1] for g in METRIC_RE.findall(documented) if g.endswith("*")]
    problems = [
        f"{name} ({metric.kind}, declared at {metric.where}) is not in README.md's '### Logs and metrics' "
        "metrics table: add a row with its type, labels and meaning"
        for name, metric in sorted(_emitted_metrics().items())
        if not re.search(rf"`{name}`", documented) and not any(name.startswith(g) for g in globs)
    ]
    _fail(problems, "Metrics the code emits that README.md does not document:")


# ----------------------------------------------------------------------------------------------- paths


def test_every_repository_path_named_in_the_docs_exists() -> None:
    problems = []
    for doc in facts.DOCS:
        text = doc.read_text(encoding="utf-8")
        made = re.findall(r"mkdir -p (\S+)", text)  # folders the reader is told to create
        for mention in facts.mentions(PATH_RE, [doc]):
            path = re.sub(r":\w+$", "", mention.name.rstrip("."))  # `file.py:function`
            if any(path == m or path.startswith(m.rstrip("/") + "/") for m in made):
                continue
            if not (ROOT / path).exists() and not list(ROOT.glob(path)):
                problems.append(f"{mention.where()}: {mention.name} does not exist in the repository")
    _fail(problems, "Paths named in the docs that do not exist:")


# ------------------------------------------------------------------------------------------------- CLI


def test_every_command_and_option_shown_in_the_docs_exists() -> None:
    commands, problems = facts.commands(), []
    for call in facts.invocations(facts.DOCS):
        if call.command == "mrc":
            options = {"--help"}
        elif call.command not in commands:
            problems.append(f"{call.where()}: `{call.command}` is not a command (known: {sorted(commands)})")
            continue
        else:
            options = commands[call.command] | {"--help"}
        problems += [
            f"{call.where()}: `{call.command}` has no option {flag} (it takes {sorted(options)})"
            for flag in call.flags
            if flag not in options
        ]
    _fail(
        problems, "Commands or options in the docs that the parsers (producer/cli.py, workers/cli.py) lack:"
    )


def test_every_command_and_option_is_shown_in_the_readme() -> None:
    shown: dict[str, set[str]] = {}
    for call in facts.invocations([README]):
        shown.setdefault(call.command, set()).update(call.flags)
    problems = []
    for command, options in sorted(facts.commands().items()):
        if command not in shown:
            problems.append(
                f"`{command}` is never shown in README.md: add its usage line to '### Command line'"
            )
        problems += [
            f"`{command} {flag}` is not shown in README.md: add it to `{command}`'s usage line"
            for flag in sorted(options - shown.get(command, set()))
        ]
    _fail(problems, "Commands or options README.md does not document:")


def _exit_table() -> dict[int, str]:
    rows = facts.table_rows(facts.section(README, "### Exit codes"))
    return {int(c[0].strip("`")): c[1] for c in rows if c and c[0].strip("`").isdigit()}


def test_the_readme_exit_code_table_matches_the_code() -> None:
    table, problems = _exit_table(), []
    codes = facts.exit_constants("producer.cli")
    for name, code in sorted(codes.items(), key=lambda item: item[1]):
        words = [w for w in name.removeprefix("EXIT_").lower().split("_") if w != "not"]
        if code not in table:
            problems.append(
                f"exit {code} ({name} in producer/cli.py) has no row in README.md's exit-code table"
            )
        elif not all(word in table[code].lower() for word in words):
            problems.append(f"exit {code} is {name} in producer/cli.py, README.md says {table[code]!r}")
    problems += [
        f"README.md's exit-code table has {c}, producer/cli.py has no such code"
        for c in set(table) - set(codes.values())
    ]
    for name, code in facts.exit_constants("producer.backlog.cli").items():
        if codes.get(name) != code:
            problems.append(f"producer/backlog/cli.py has {name} = {code}, producer/cli.py {codes.get(name)}")
    _fail(problems, "README.md's exit codes and the code disagree:")


# --------------------------------------------------------------------------------------------- figures


def test_measured_figures_quoted_outside_the_measurement_pages_appear_there() -> None:
    """A figure (a number with ms, s, ×, % or a …/s rate) stated outside docs/benchmarks.md and
    docs/scaling.md, the pages that give each figure with the command that produced it, must be one
    of theirs: the same number with the same unit there, or, for a distinctive number (a decimal, or
    three digits and more), the same number anywhere on them (their tables give units in headers).
    Times and shares equal to a number written in the code, the deploy files or a setting's default
    are configured constants (a 30 s claim, 85 % of free memory), not measurements."""
    pages = "\n".join(page.read_text(encoding="utf-8") for page in MEASUREMENT_PAGES)
    measured = {(facts.plain(n), unit) for n, unit in facts.figures(pages)}
    numbers = {facts.plain(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", pages)}
    constants = facts.code_constants()
    problems = []
    for doc in facts.DOCS:
        if doc in MEASUREMENT_PAGES:
            continue
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            for value, unit in facts.figures(line):
                key = (facts.plain(value), unit)
                distinctive = "." in value or len(value) >= 3
                if key in measured or (distinctive and key[0] in numbers):
                    continue
                if unit in ("ms", "s", "%") and key[0] in constants:
                    continue
                problems.append(
                    f"{facts.rel(doc)}:{number}: {value} {unit} is in neither docs/benchmarks.md nor "
                    "docs/scaling.md"
                )
    _fail(problems, "Measured figures quoted without their measurement (put them in docs/benchmarks.md):")


# ------------------------------------------------------------------------------------------ the README


def test_the_readme_opens_with_the_two_commands_and_reads_in_a_newcomers_order() -> None:
    text = README.read_text(encoding="utf-8")
    first_block = text.split("```")[1]
    assert "make demo" in first_block, "README must open with the two commands"
    assert "make test" in first_block, "README must open with the two commands"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    order = ["## What it is", "## What the demo shows", "## Run it yourself", "## Reference"]
    at = [next((i for i, h in enumerate(headings) if h.startswith(o)), -1) for o in order]
    assert -1 not in at, f"README lacks one of the sections {order}; found {headings}"
    assert at == sorted(at), f"README's sections must come in this order: {order}; found {headings}"
