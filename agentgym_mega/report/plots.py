"""The report's curves, drawn by matplotlib as inline SVG (text kept as text, no external references)."""

from __future__ import annotations

import io
import re

_EVAL_CATEGORY = re.compile(r"^eval/(.+)/success$")
# (title, [(metric, label)], y limits or None); eval curves are drawn as points joined by dashes
CURVES = (
    ("Training reward and success", [("reward/mean", "train reward"), ("reward/success_rate", "train success"),
                                     ("eval/success", "held-out success")], (0, 1.05)),
    ("KL to the reference policy", [("actor/ref_kl", "actor/ref_kl")], None),
    ("Entropy", [("actor/entropy", "actor/entropy")], None),
    ("Clip fraction", [("actor/clip_fraction", "actor/clip_fraction")], None),
)


def curves(metrics: dict[int, dict]) -> list[dict]:
    """One figure per curve group: {"title", "svg", "note"}: the SVG where the metrics hold
    the curve, else a note saying what is missing."""
    categories = sorted({m.group(1) for r in metrics.values() for k in r if (m := _EVAL_CATEGORY.match(k))})
    per_category = [("eval/success", "overall")] + [(f"eval/{c}/success", c) for c in categories]
    groups = list(CURVES[:1]) + [("Held-out success per category", per_category, (0, 1.05))] + list(CURVES[1:])
    caps = cap_changes(metrics)
    figures = []
    for title, series, ylim in groups:
        if not any(key in r for r in metrics.values() for key, _ in series):
            figures.append({"title": title, "svg": None,
                            "note": "not in metrics.jsonl: " + ", ".join(k for k, _ in series)})
        else:
            figures.append({"title": title, "svg": _figure(metrics, series, ylim, caps), "note": None})
    return figures


def cap_changes(metrics: dict[int, dict]) -> list[tuple[int, object]]:
    """(step, cap) where horizon/turn_cap takes a new value: the ScalingInter stages."""
    changes, before = [], None
    for step in sorted(metrics):
        cap = metrics[step].get("horizon/turn_cap")
        if cap is not None and cap != before:
            changes.append((step, cap))
            before = cap
    return changes


def _figure(metrics: dict[int, dict], series: list, ylim, caps) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 9}):
        fig, ax = plt.subplots(figsize=(5.6, 3.0))
        for key, label in series:
            steps = sorted(s for s, r in metrics.items() if isinstance(r.get(key), (int, float)))
            values = [metrics[s][key] for s in steps]
            style = "o--" if key.startswith("eval/") else "-"
            # a "$" in a category name would start matplotlib's mathtext
            ax.plot(steps, values, style, label=label.replace("$", r"\$"), markersize=4,
                    linewidth=1.4 if style == "-" else 1)
        for step, cap in caps:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            ax.annotate(f"cap {cap}", (step, 1), xycoords=("data", "axes fraction"), fontsize=7, color="grey",
                        xytext=(2, -10), textcoords="offset points")
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="best")
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
        plt.close(fig)
    return _bare_svg(buffer.getvalue())


def _bare_svg(svg: str) -> str:
    """The <svg> element alone: no XML declaration or DOCTYPE (whose DTD address the page must
    not carry), and no RDF metadata."""
    svg = svg[svg.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
