"""The status page and the join page: server-rendered HTML, the plot as an inlined matplotlib PNG, no script and
no asset from anywhere (each page's CSP allows its one inline style by hash, and data: images)."""

from __future__ import annotations

import base64
import functools
import html
import io
import time
from typing import Any, NamedTuple

from edgepfl.server.headers import page_policy

PAGE_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:64em;color:#222;line-height:1.4}"
    "img{max-width:100%;height:auto}.rounds{overflow-x:auto}table{border-collapse:collapse}"
    "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}"
    "th{background:#f4f4f4;white-space:normal;vertical-align:bottom;min-width:5em}th:nth-child(-n+2){min-width:0}"
    "@media (max-width:40em){body{padding:0 .6em}td,th{padding:.2em .4em;font-size:.9em}}"
    "a.add{display:inline-block;margin:.2em 0;padding:.45em 1em;border-radius:.3em;background:#1a7f4b;color:#fff;"
    "font-weight:600;text-decoration:none}"
)
JOIN_STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1em auto;padding:0 1em;max-width:40em;color:#222;line-height:1.4}"
    "a{word-break:break-all}svg{max-width:100%;height:auto}input{font:inherit;margin:0 .3em;width:5em}"
    "button{font:inherit;padding:.3em .9em}label{display:inline-block;margin:.2em 0}"
)
STATUS_PAGE_POLICY = page_policy(PAGE_STYLE)
JOIN_PAGE_POLICY = page_policy(JOIN_STYLE, form_action="'self'")
JOIN_PATH = "/join"
# the accuracy columns and curves; one whose numbers equal another's in every round is shown once, named by both
ACCURACIES = (
    ("start_val_accuracy", "held acc at round start", "held model, at round start"),
    ("val_accuracy", "val acc after training", "after training, at upload"),
    ("eval_accuracy", "personalized acc", "personalized, after round"),
)


class DeviceNote(NamedTuple):
    """What the status page says about how phones join, whether it links to /join ("Add a device"), and whether
    the device page is served at all."""

    text: str
    add_device: bool = False
    page: bool = False


def render_page(status: dict[str, Any], web_note: str = "", add_device: bool = False) -> str:
    """A self-contained HTML page summarising the rounds so far (and how phones join: `web_note`, with an
    "Add a device" link to /join when `add_device`); readable on a phone (the table scrolls on its own)."""
    png = base64.b64encode(render_plot(status)).decode("ascii")
    head = (
        f"strategy <b>{html.escape(status['strategy'])}</b> · personal <b>{html.escape(status.get('personal', ''))}</b>"
        f" · state <b>{status['state']}</b> · "
        f"{status['rounds_completed']} of {status['rounds_target']} rounds · "
        f"{status['devices_enrolled']} devices enrolled, {status['devices_available']} available"
    )
    names = status.get("class_names") or []
    if names:
        more = f", … ({len(names)} classes)" if len(names) > 20 else ""
        head += "<br>classes: " + html.escape(", ".join(names[:20]) + more)
    privacy = status.get("privacy")
    if privacy is not None:
        target = f" of target {privacy['target_epsilon']:g}" if privacy["target_epsilon"] is not None else ""
        head += (
            f"<br>differential privacy: <b>ε = {privacy['epsilon']:.4g}</b>{target} at δ = {privacy['delta']:g} "
            f"(σ = {privacy['noise_multiplier']:g}, clip {privacy['clip_norm']:g}, user level)"
        )
    secure = status.get("secure_aggregation")
    if secure is not None:
        head += (
            f"<br>secure aggregation: <b>the server sees only each round's sum</b> (clip {secure['clip_norm']:g}"
            f"{' measured' if 'clip' in secure.get('measured', []) else ''}, "
            f"threshold {secure['threshold']:g}, neighbours {html.escape(str(secure['neighbours']))})"
        )
    if status.get("stopped"):
        head += f"<br>{html.escape(status['stopped'])}"
    for warning in status.get("fleet_warnings") or []:
        head += f"<br><b>{html.escape(warning)}</b>"  # a fleet setting that cannot work
    add = f' <a class="add" href="{JOIN_PATH}">Add a device</a>' if add_device else ""
    fleet = fleet_section(status, time.time())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgepfl server</title><style>{PAGE_STYLE}</style>
</head><body>
<h1>edgepfl server</h1>
<p>{head}</p>
<p id="join">{html.escape(web_note)}{add}</p>
{fleet}<img alt="device accuracy per round" src="data:image/png;base64,{png}">
<div class="rounds">{_table(list(reversed(status["rounds"])))}</div>
</body></html>
"""


SECURE_STEPS = {  # what a secure round's step is doing, in the status page's words
    "keys": "collecting the devices' keys",
    "shares": "passing on the devices' encrypted shares",
    "inputs": "collecting the masked updates",
    "unmask": "collecting what unmasks the sum",
    "done": "unmasking the sum",
}


def fleet_section(status: dict[str, Any], now: float) -> str:
    """What the round waits for: a sync round's missing devices (or their count: only the operator's view names
    them) and when it gives up, or FedBuff's base version, buffer fill and its devices' staleness ("" when there
    is nothing to say)."""
    buffered = status.get("fedbuff")
    if buffered is not None:
        head = (
            f"FedBuff: base version <b>{buffered['base_version']}</b> · buffer {buffered['buffered']} / "
            f"{buffered['buffer_size']} uploads · uploads over {buffered['max_staleness']} versions old are refused"
        )
        return f'<div id="fleet"><p>{head}</p>{_staleness_table(buffered)}</div>\n'
    open_round = status.get("open_round")
    if open_round is None:
        return ""
    step, count = open_round.get("secure_step"), open_round["waiting_for"]
    named = open_round.get("missing")  # the operator's view names the devices; everyone else sees how many
    if named:
        waiting = f"waiting for {', '.join(html.escape(name) for name in named[:20])}" + (
            f" and {len(named) - 20} more" if len(named) > 20 else ""
        )
    elif count:
        waiting = f"waiting for {count} device{'s' if count != 1 else ''}"
    else:
        waiting = "every device has answered this step" if step else "every sampled device has uploaded"
    left = open_round["gives_up_at"] - now
    when = time.strftime("%H:%M:%S", time.localtime(open_round["gives_up_at"]))
    ends = "this step ends" if step and step != "keys" else "gives up"  # a secure step closes with who answered
    gives_up = f"{ends} at {when} (in {_duration(left)})" if left > 0 else f"{'ended' if step else 'gave up'} at {when}"
    refused = open_round.get("refused")
    if refused:
        refusals = f" · refused its base: {', '.join(html.escape(name) for name in refused)}"
    else:
        refusals = f" · {open_round['refused_base']} refused its base" if open_round["refused_base"] else ""
    progress = (
        f"secure aggregation, {SECURE_STEPS.get(step, step)}"
        if step
        else f"{open_round['uploads']} of the {open_round['target']} uploads it needs"
    )
    return f'<p id="fleet">Round <b>{open_round["round"]}</b>: {progress} · {waiting} · {gives_up}{refusals}</p>\n'


def _staleness_table(buffered: dict[str, Any]) -> str:
    """FedBuff's devices: each one's last upload for the operator (its names), else how many at each staleness."""
    devices = buffered.get("devices")
    if devices is None:
        counts = buffered["devices_by_staleness"]
        cells = ", ".join(f"{n} at staleness {s}" for s, n in counts.items())
        return f"<p>devices by the staleness of their last upload: {cells}</p>" if counts else ""
    rows = sorted(devices.items(), key=lambda item: (-item[1]["round"], item[0]))
    lines = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{last['round']}</td><td>{last['staleness']}</td>"
        f"<td>{last['applied'] if last['applied'] is not None else 'in the buffer'}</td></tr>"
        for name, last in rows[:50]
    )
    more = f"<p>… and {len(rows) - 50} more devices</p>" if len(rows) > 50 else ""
    return (
        '<div class="rounds"><table><tr><th>device</th><th>last trained on version</th><th>staleness</th>'
        f"<th>applied in step</th></tr>{lines}</table></div>{more}"
        if rows
        else ""
    )


def _duration(seconds: float) -> str:
    """A wait as people say it: 45 s, 4 min, 2 h 5 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds // 3600} h {round(seconds % 3600 / 60)} min"


def render_join_page(url: str, note: str, shared: bool = False) -> str:
    """A join link and its QR code (SVG by `segno`), a line about it (`note`), and a form for a link that expires.

    The fleet-wide link (`shared`: it holds the enrollment secret and never expires) comes last, folded away: the
    page leads with the form, set to make a link for one device that expires in an hour.
    """
    import segno

    qr = segno.make(url, error="m").svg_inline(scale=6, border=2, title="join link")
    link = html.escape(url, quote=True)
    shown = f"""<p>Scan the code with a phone, or open the link on any device. {html.escape(note)}</p>
<p>{qr}</p>
<p><a id="join-link" href="{link}">{link}</a></p>"""
    form = f"""<form method="post" action="{JOIN_PATH}"><h2>{"A link for one device" if shared else "Another link"}, \
that expires</h2>
<label>expires after <input name="expires" value="1h" size="5" required> (30m, 1h, 2d)</label>
<label>for at most <input name="max_devices" type="number" min="1" size="4" value="1" placeholder="any"> \
devices</label>
<button type="submit">Make a link</button></form>"""
    body = (
        f"{form}\n<details><summary>The fleet-wide link (never expires)</summary>\n{shown}\n</details>"
        if shared
        else f"{shown}\n{form}"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgepfl: join</title><style>{JOIN_STYLE}</style>
</head><body>
<h1>Join this edgepfl server</h1>
{body}
</body></html>
"""


def render_plot(status: dict[str, Any]) -> bytes:
    """PNG of mean (line) and min-max (band) device accuracy per closed round (equal curves drawn once)."""
    curves: dict[tuple, list[str]] = {}
    for key, _, label in ACCURACIES:
        points = tuple(
            (r["round"], r[key]["mean"], r[key]["min"], r[key]["max"]) for r in status["rounds"] if r[key] is not None
        )
        curves.setdefault(points, []).append(label)
    return _plot_png(tuple((" = ".join(labels), points) for points, labels in curves.items()))


@functools.lru_cache(maxsize=4)
def _plot_png(series: tuple[tuple[str, tuple[tuple[int, float, float, float], ...]], ...]) -> bytes:
    # cached on the plotted numbers: a page reload between rounds costs no matplotlib time
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # 500 px wide, large text, the legend under the axes: a phone shows it at its width and no curve is covered
    with rc_context({"font.size": 12}):
        figure = Figure(figsize=(5, 4.2), dpi=100, layout="constrained")
        canvas = FigureCanvasAgg(figure)
        axes = figure.add_subplot(1, 1, 1)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
        for label, points in series:
            if points:
                xs = [x for x, *_ in points]
                line = axes.plot(xs, [mean for _, mean, _, _ in points], marker="o", markersize=3, label=label)[0]
                lows, highs = [low for *_, low, _ in points], [high for *_, high in points]
                axes.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2)
        axes.set_xlabel("round")
        axes.set_ylabel("device accuracy")
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
        if axes.lines:
            figure.legend(loc="outside lower center", frameon=False)
        else:
            axes.text(0.5, 0.5, "no rounds yet", ha="center", va="center", transform=axes.transAxes)
        buffer = io.BytesIO()
        canvas.print_png(buffer)
    return buffer.getvalue()


def _table(rounds: list[dict[str, Any]]) -> str:
    """The rounds as a table (newest first) of the columns that hold anything; accuracy columns that read the
    same in every round (the trained and the personalized model, in FedPer) are one column named by both."""
    columns: list[tuple[str, list[str]]] = [
        ("round", [str(r["round"]) for r in rounds]),
        ("state", [r["state"] for r in rounds]),
        ("uploads / sampled", [f"{r['uploads']} / {r['sampled']}" for r in rounds]),
    ]
    same: dict[tuple[str, ...], int] = {}
    for key, header, _ in ACCURACIES:
        cells = tuple(f"{r[key]['mean']:.3f}" if r[key] else "–" for r in rounds)
        if cells in same:
            name, _ = columns[same[cells]]
            columns[same[cells]] = (f"{name} = {header}", list(cells))
        else:
            same[cells] = len(columns)
            columns.append((header, list(cells)))
    columns[3:] = [(f"{name} (mean)", cells) for name, cells in columns[3:]]
    columns += [
        ("train loss", [f"{r['train_loss']['mean']:.3f}" if r["train_loss"] else "–" for r in rounds]),
        ("upload bytes", [str(r["upload_bytes"]) for r in rounds]),
        ("ε", [f"{r['epsilon']:.4g}" if r.get("epsilon") is not None else "–" for r in rounds]),
        ("secure: masked / dropped / recovered", [_secure_cell(r.get("secure_aggregation")) for r in rounds]),
        (
            "aggregation s",
            [f"{r['aggregate_seconds']:.3f}" if r["aggregate_seconds"] is not None else "–" for r in rounds],
        ),
        (
            "closed",
            [time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["closed"])) if r["closed"] else "–" for r in rounds],
        ),
        ("note", [html.escape(r["note"] or "") for r in rounds]),
    ]
    shown = [
        (name, cells) for i, (name, cells) in enumerate(columns) if i < 3 or any(c not in ("–", "") for c in cells)
    ]
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in shown)
    rows = "\n".join(
        "<tr>" + "".join(f"<td>{cells[i]}</td>" for _, cells in shown) + "</tr>" for i in range(len(rounds))
    )
    return f"<table><tr>{head}</tr>\n{rows}\n</table>"


def _secure_cell(summary: dict[str, Any] | None) -> str:
    """A secure round's counts (devices in the sum, dropped, whose masks were recovered), or its step while open."""
    if summary is None:
        return "–"
    if "masked" not in summary:
        return html.escape(summary["phase"])
    return f"{summary['masked']} / {summary['dropped']} / {summary['recovered']}"
