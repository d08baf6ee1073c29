"""The ops page's HTML, rendered on the server from the state (producer/ops/state.py): every value
escaped, no template engine, nothing loaded from elsewhere. The page's script (OPS_JS, served by
mrc-api at /ops/page.js) fetches the main part again every few seconds and puts it in place."""

from __future__ import annotations

import html
import time
from typing import Any

OPS_JS = """'use strict';
// Fetch the page's main part again every few seconds (the server renders it); keep the last one on error.
(function () {
  const main = document.getElementById('ops-main');
  const every = Number(main.dataset.refreshS || 5) * 1000;
  let busy = false;  // one request at a time: a slow server is not sent more
  async function refresh() {
    if (busy) return;
    busy = true;
    const stop = new AbortController();
    const timer = setTimeout(() => stop.abort(), Math.max(every, 10000));
    try {
      const options = {credentials: 'same-origin', cache: 'no-store', signal: stop.signal};
      const reply = await fetch('/ops?part=main', options);
      if (reply.ok) {
        main.innerHTML = await reply.text();
        document.getElementById('ops-status').textContent = 'updated ' + new Date().toLocaleTimeString();
      } else {
        document.getElementById('ops-status').textContent = 'refresh failed: HTTP ' + reply.status;
      }
    } catch (err) {
      document.getElementById('ops-status').textContent = 'refresh failed: ' + err;
    } finally {
      clearTimeout(timer);
      busy = false;
    }
  }
  setInterval(refresh, every);
})();
"""

_CSS = "\n".join(
    [
        "body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}",
        "header{background:#1d2330;color:#fff;padding:10px 16px;display:flex;gap:16px;flex-wrap:wrap}",
        "header h1{font-size:18px;margin:0}",
        "main{padding:8px 16px}",
        "section{margin:12px 0}",
        "h2{font-size:15px;margin:8px 0}",
        ".scroll{overflow-x:auto}",
        "table{border-collapse:collapse;background:#fff;min-width:100%}",
        "th,td{padding:4px 8px;border-bottom:1px solid #e3e6ea;text-align:left;white-space:nowrap}",
        "th{font-weight:600;color:#556}",
        ".bad{color:#b00020;font-weight:600}",
        ".warn{color:#a15c00;font-weight:600}",
        ".ok{color:#0a7d32}",
        ".bar{background:#e3e6ea;width:140px;height:10px;display:inline-block;vertical-align:middle;"
        "border-radius:3px;overflow:hidden}",
        ".bar span{display:block;height:100%;float:left}",
        ".done{background:#0a7d32}",
        ".failed{background:#b00020}",
        ".used{background:#3867d6}",
        "code{background:#eef0f3;padding:1px 4px;border-radius:3px}",
        "ul.problems li{margin:2px 0}",
        "svg.spark{vertical-align:middle}",
    ]
)


def e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def page(state: dict[str, Any], refresh_s: float) -> str:
    body = f'<main id="ops-main" data-refresh-s="{refresh_s:g}">{main(state)}</main>'
    return _shell("mrc ops", body, refresh_s)


def main(state: dict[str, Any]) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(state["generated_at"]))
    return "".join(
        [
            f'<p class="stamp">State at <span id="ops-generated">{e(at)}</span></p>',
            _problems(state),
            _lanes(state["lanes"]),
            _workers(state["workers"]),
            _runs(state["runs"]),
            _dead_letter(state["dead_letter"]),
            _errors_and_latency(state["errors_last_hour"], state["latency"]),
            _usage(state["usage_today"]),
        ]
    )


def login(message: str = "") -> str:
    note = f'<p class="bad">{e(message)}</p>' if message else ""
    form = (
        '<form method="post" action="/ops/login"><label>API key with the <code>ops</code> scope '
        '<input type="password" name="key" id="ops-key" autocomplete="off" required></label> '
        '<button type="submit" id="ops-login">Open</button></form>'
    )
    return _shell("mrc ops: sign in", f"<main>{note}<p>The ops page needs a key.</p>{form}</main>")


def forbidden() -> str:
    body = (
        '<main><p class="bad" id="ops-forbidden">403: this key has no <code>ops</code> scope.</p>'
        "<p>An operator's key is written <code>SHA256HEX@ops</code> in <code>MRC_API_KEYS</code> "
        '(or beside its lanes: <code>SHA256HEX@interactive+backlog+ops</code>). <a href="/ops/logout">'
        "Use another key</a>.</p></main>"
    )
    return _shell("mrc ops: forbidden", body)


def _shell(title: str, body: str, refresh_s: float | None = None) -> str:
    script = '<script src="/ops/page.js" defer></script>' if refresh_s else ""
    status = f"refreshes every {refresh_s:g} s" if refresh_s else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)}</title><style>{_CSS}</style>{script}</head><body>"
        f'<header><h1>{e(title)}</h1><span id="ops-status">{status}</span>'
        '<a href="/ops/state" style="color:#cde">JSON</a></header>'
        f"{body}</body></html>"
    )


def _table(table_id: str, heads: list[str], rows: list[str], empty: str) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in heads)
    body = "".join(rows) or f'<tr><td colspan="{len(heads)}">{e(empty)}</td></tr>'
    return f'<div class="scroll"><table id="{e(table_id)}"><tr>{head}</tr>{body}</table></div>'


def _row(cells: list[str], **attrs: object) -> str:
    """A table row; cells are HTML already (escape values with e())."""
    data = "".join(f' data-{k}="{e(v)}"' for k, v in attrs.items())
    return f"<tr{data}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _section(title: str, body: str) -> str:
    return f"<section><h2>{title}</h2>{body}</section>"


def _problems(state: dict[str, Any]) -> str:
    items = [*_queue_problems(state), *(_worker_problem(w) for w in state["workers"])]
    items = [item for item in items if item]
    if not items:
        return _section("Problems", '<p class="ok" id="ops-problems">None seen.</p>')
    lis = "".join(f"<li>{item}</li>" for item in items)
    return _section("Problems", f'<ul class="problems" id="ops-problems">{lis}</ul>')


def _queue_problems(state: dict[str, Any]) -> list[str]:
    items = []
    dlq = state["dead_letter"]
    if dlq["count"]:
        items.append(f"{dlq['count']} job(s) in the dead-letter list: <code>{e(dlq['command'])}</code>")
    if not state["workers"]:
        items.append("no worker is live: start one (<code>mrc-worker</code>)")
    backlog = state["lanes"].get("backlog", {})
    if backlog.get("limit_used") is not None and backlog["limit_used"] >= 0.9:
        items.append("the backlog lane is near its depth limit (<code>MRC_BACKLOG_MAX_DEPTH</code>)")
    for code, count in state["errors_last_hour"].items():
        items.append(
            f"{count} job(s) failed <code>{e(code)}</code> in the last hour: <code>mrc events</code>"
        )
    return items


def _worker_problem(w: dict[str, Any]) -> str:
    name = e(w.get("hostname"))
    if w.get("dead"):
        return f"worker {name} stopped beating: look at its log, restart it"
    if w.get("unreadable"):
        return f"worker {name}: its heartbeat is not a JSON object (an mrc-worker of another version?)"
    if w.get("stuck"):
        return f"worker {name} has held a batch for {e(w.get('batch_in_progress_s'))} s (its /healthz fails)"
    if w.get("late"):
        return f"worker {name}: last beat {e(w.get('beat_age_s'))} s ago"
    if not w.get("ready", True):
        return f"worker {name} not ready: {e(w.get('not_ready_reason'))}"
    return ""


def _spark(values: list[int | None]) -> str:
    points = [0 if v is None else int(v) for v in values]
    top = max(points, default=0) or 1
    step = 80 / max(1, len(points) - 1)
    line = " ".join(f"{i * step:.1f},{18 - 16 * v / top:.1f}" for i, v in enumerate(points))
    last = points[-1] if points else 0
    return (
        f'<svg class="spark" width="84" height="20" aria-label="{e(points)}"><polyline fill="none" '
        f'stroke="#3867d6" stroke-width="1.5" points="{line}"/></svg> {last}'
    )


def _bar(parts: list[tuple[str, float]]) -> str:
    spans = "".join(
        f'<span class="{kind}" style="width:{max(0.0, min(1.0, share)) * 100:.1f}%"></span>'
        for kind, share in parts
    )
    return f'<span class="bar">{spans}</span>'


def _lanes(lanes: dict[str, Any]) -> str:
    rows = []
    for lane, v in lanes.items():
        limit = "-"
        if v["depth_limit"] is not None:
            limit = f"{_bar([('used', v['limit_used'])])} {e(v['depth'])}/{e(v['depth_limit'])}"
        held, each = v.get("held_by_key") or {}, v.get("share_each")
        if each is not None:  # the lane's shares (shared/backlog_share.py): who holds what of it
            keys = ", ".join(f"{e(key)}: {e(count)}" for key, count in held.items())
            limit += (
                f'<br><span class="shares">shared by {len(held)} keys, {e(each)} each '
                f"({keys} queued or running)</span>"
            )
        cells = [e(lane), f'<span class="depth">{e(v["depth"])}</span>', e(v["in_flight"])]
        cells += [f"{e(v['oldest_age_s'])} s", limit, _spark(v["in_per_min"]), _spark(v["out_per_min"])]
        rows.append(_row(cells, lane=lane))
    heads = ["lane", "queued", "held by workers", "oldest", "depth limit", "in /min", "out /min"]
    return _section("Lanes", _table("ops-lanes", heads, rows, "no lanes"))


def _worker_state(w: dict[str, Any]) -> str:
    if w.get("dead"):
        return '<span class="bad">dead</span>'
    if w.get("unreadable"):
        return '<span class="bad">unreadable heartbeat</span>'
    if w.get("stuck"):
        return '<span class="bad">stuck</span>'
    if w.get("late"):
        return '<span class="warn">late</span>'
    if not w.get("ready", True):
        return f'<span class="warn">not ready: {e(w.get("not_ready_reason"))}</span>'
    return '<span class="ok">ready</span>'


def _worker_row(w: dict[str, Any]) -> str:
    if w.get("dead") or w.get("unreadable"):
        return _row([e(w.get("hostname")), *[""] * 7, _worker_state(w)], worker=w.get("hostname"))
    slots = int(w.get("engine_slots") or 0)
    running = int(w.get("engine_rows_running") or 0)
    gpu = "-"
    if w.get("gpu_memory_total_bytes"):
        used, total = w.get("gpu_memory_allocated_bytes") or 0, w["gpu_memory_total_bytes"]
        gpu = f"{used / 2**30:.1f} / {total / 2**30:.0f} GiB"
    rows = f"{running} / {e(w.get('engine_rows_held', 0))} / {e(w.get('engine_rows_waiting', 0))}"
    cells = [
        e(w.get("hostname")), e(",".join(w.get("lanes", []))),
        f"{e(w.get('model'))} {e(w.get('quantization'))}", e(w.get("device")), rows,
        f"{_bar([('used', running / slots if slots else 0)])} {running}/{slots}", e(gpu),
        f"{e(w.get('beat_age_s'))} s", _worker_state(w),
    ]  # fmt: skip
    return _row(cells, worker=w.get("hostname"))


def _workers(workers: list[dict[str, Any]]) -> str:
    heads = ["worker", "lanes", "model", "device", "rows running / held / waiting", "slots", "GPU memory",
             "last beat", "state"]  # fmt: skip
    return _section("Workers", _table("ops-workers", heads, [_worker_row(w) for w in workers], "none live"))


def _run_row(r: dict[str, Any]) -> str:
    jobs = r["jobs"] or 1
    bar = _bar([("done", r["succeeded"] / jobs), ("failed", r["failed"] / jobs)])
    progress = f'{bar} <span class="progress">{e(r["succeeded"] + r["failed"])}/{e(r["jobs"])}</span>'
    eta = "-" if r["eta_s"] is None else f"{e(r['eta_s'])} s"
    rate = "-" if r["rate_per_s"] is None else f"{e(r['rate_per_s'])}/s"
    cells = [e(r["run_id"]), e(r["kind"]), e(r["state"]), progress, e(r["succeeded"]), e(r["failed"]),
             e(r["remaining"]), rate, eta]  # fmt: skip
    return _row(cells, run=r["run_id"])


def _runs(runs: dict[str, Any]) -> str:
    heads = ["run", "kind", "state", "progress", "done", "failed", "left", "rate", "ends in"]
    running = _table("ops-runs", heads, [_run_row(r) for r in runs["running"]], "none in progress")
    finished = _table("ops-runs-finished", heads, [_run_row(r) for r in runs["finished"]], "none")
    hint = "<p><code>mrc backlog status RUN_ID</code> has a run's counts by error code.</p>"
    return _section("Backlog runs and batches", f"{running}<h2>Finished lately</h2>{finished}{hint}")


def _dead_letter(dlq: dict[str, Any]) -> str:
    rows = [_row([e(x.get(k)) for k in ("job_id", "code", "attempts", "at")]) for x in dlq["newest"]]
    table = _table("ops-dlq-entries", ["job", "code", "attempts", "at"], rows, "none")
    command = (
        f'<p>To send them back to their lanes: <code id="ops-dlq-command">{e(dlq["command"])}</code> '
        "(<code>mrc dlq list</code> shows them whole).</p>"
    )
    return _section(f'Dead letters: <span id="ops-dlq-count">{e(dlq["count"])}</span>', table + command)


def _errors_and_latency(errors: dict[str, int], latency: dict[str, Any]) -> str:
    rows = [_row([e(code), e(count)], code=code) for code, count in errors.items()]
    failures = _table("ops-errors", ["code", "jobs"], rows, "none")
    lat = [
        _row([e(lane), e(v["jobs"]), _le(v["p50_le_s"]), _le(v["p99_le_s"])])
        for lane, v in latency.items()
        if lane != "minutes"
    ]
    title = f"Latency, submission to result, last {e(latency['minutes'])} minutes"
    times = _table("ops-latency", ["lane", "jobs", "p50", "p99"], lat, "none")
    return _section("Failures in the last hour, by code", f"{failures}<h2>{title}</h2>{times}")


def _le(bound: object) -> str:
    return "-" if bound is None else f"≤ {e(bound)} s"


def _usage(usage: dict[str, dict[str, int]]) -> str:
    kinds = ("jobs", "prompt_tokens", "image_tokens", "completion_tokens")
    rows = [_row([e(key), *(e(v.get(k, 0)) for k in kinds)], key=key) for key, v in usage.items()]
    heads = ["key", "jobs", "prompt tokens", "image tokens", "completion tokens"]
    return _section("Usage today (UTC), by API key", _table("ops-usage", heads, rows, "none yet"))
