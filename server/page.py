"""The status page: server-rendered HTML with an embedded matplotlib PNG, no external assets."""

from __future__ import annotations

import base64
import functools
import html
import io
import time
from typing import Any


def render_page(status: dict[str, Any], web_note: str = "") -> str:
    """A self-contained HTML page summarising the rounds so far (and how phones join: `web_note`)."""
    png = base64.b64encode(render_plot(status)).decode("ascii")
    rows = "\n".join(_row(r) for r in reversed(status["rounds"]))
    head = (
        f"strategy <b>{html.escape(status['strategy'])}</b> · state <b>{status['state']}</b> · "
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
    if status.get("stopped"):
        head += f"<br>{html.escape(status['stopped'])}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>edgepfl server</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse}}
td,th{{padding:.2em .7em;border-bottom:1px solid #ddd;text-align:right}}th{{background:#f4f4f4}}</style>
</head><body>
<h1>edgepfl server</h1>
<p>{head}</p>
<p id="join">{html.escape(web_note)}</p>
<img alt="device accuracy per round" src="data:image/png;base64,{png}">
<table><tr><th>round</th><th>state</th><th>uploads / sampled</th><th>held acc at round start (mean)</th>
<th>val acc after training (mean)</th>
<th>personalized acc (mean)</th><th>train loss</th><th>upload bytes</th><th>ε</th><th>aggregation s</th><th>closed</th>
<th>note</th></tr>
{rows}
</table></body></html>
"""


def render_join_page(url: str) -> str:
    """The join link and its QR code (SVG by `segno`); the link holds the enrollment secret in its fragment."""
    import segno

    qr = segno.make(url, error="m").svg_inline(scale=6, border=2, title="join link")
    link = html.escape(url, quote=True)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgepfl: join</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}a{{word-break:break-all}}</style>
</head><body>
<h1>Join this edgepfl server</h1>
<p>Scan the code with a phone, or open the link on any device. The link holds the enrollment secret:
show it only to the people whose phones should take part.</p>
<p>{qr}</p>
<p><a id="join-link" href="{link}">{link}</a></p>
</body></html>
"""


def render_plot(status: dict[str, Any]) -> bytes:
    """PNG of mean (line) and min-max (band) device accuracy per closed round."""
    series = tuple(
        (
            label,
            tuple(
                (r["round"], r[key]["mean"], r[key]["min"], r[key]["max"])
                for r in status["rounds"]
                if r[key] is not None
            ),
        )
        for key, label in (
            ("start_val_accuracy", "held model (round's base, before training)"),
            ("val_accuracy", "validation (after training, at upload)"),
            ("eval_accuracy", "personalized (after round)"),
        )
    )
    return _plot_png(series)


@functools.lru_cache(maxsize=4)
def _plot_png(series: tuple[tuple[str, tuple[tuple[int, float, float, float], ...]], ...]) -> bytes:
    # cached on the plotted numbers: a page reload between rounds costs no matplotlib time
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    for label, points in series:
        if points:
            xs = [x for x, *_ in points]
            line = axes.plot(xs, [mean for _, mean, _, _ in points], marker="o", markersize=3, label=label)[0]
            axes.fill_between(
                xs, [low for *_, low, _ in points], [high for *_, high in points], color=line.get_color(), alpha=0.2
            )
    axes.set_xlabel("round")
    axes.set_ylabel("device accuracy")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(loc="lower right")
    else:
        axes.text(0.5, 0.5, "no rounds yet", ha="center", va="center", transform=axes.transAxes)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _row(r: dict[str, Any]) -> str:
    def mean(key: str) -> str:
        return f"{r[key]['mean']:.3f}" if r[key] else "–"

    seconds = f"{r['aggregate_seconds']:.3f}" if r["aggregate_seconds"] is not None else "–"
    closed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["closed"])) if r["closed"] else "–"
    epsilon = f"{r['epsilon']:.4g}" if r.get("epsilon") is not None else "–"
    return (
        f"<tr><td>{r['round']}</td><td>{r['state']}</td><td>{r['uploads']} / {r['sampled']}</td>"
        f"<td>{mean('start_val_accuracy')}</td><td>{mean('val_accuracy')}</td><td>{mean('eval_accuracy')}</td>"
        f"<td>{mean('train_loss')}</td>"
        f"<td>{r['upload_bytes']}</td><td>{epsilon}</td>"
        f"<td>{seconds}</td><td>{closed}</td><td>{html.escape(r['note'] or '')}</td></tr>"
    )
