"""`agentgym-mega report`: one self-contained HTML page from a run directory: the run at a glance,
curves, evaluation tables, an episode browser and the same held-out task over time. Nothing on the
page is fetched: the curves are inline SVG, the script and style are inlined, and the episodes ride
along as one JSON blob that the script renders a page of results at a time."""

from __future__ import annotations

import json
import math
import os
from importlib import resources

from agentgym_mega.report import data, plots

__all__ = ["build"]


def build(run_dir: str, out: str | None = None) -> str:
    """Writes the report of `run_dir` to `out` (default RUN_DIR/report.html); returns its path.
    Raises BadInput when `run_dir` is not a run."""
    import jinja2

    run = data.read_run(run_dir)
    out = out or os.path.join(run_dir, "report.html")
    files = resources.files(__package__)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    template = env.from_string(files.joinpath("page.html.j2").read_text(encoding="utf-8"))
    missing = data.steps_without_metrics(run) if run.metrics else []
    notes = run.notes + ([f"no metrics.jsonl line for step(s) {missing}"] if missing else [])
    html = template.render(
        title=(run.config.get("logging") or {}).get("experiment") or os.path.basename(run.path),
        summary=data.summary(run), phases=data.phase_times(run), curves=plots.curves(run.metrics),
        evals=data.eval_tables(run), notes=notes, episode_count=len(run.episodes),
        episodes_json=script_json(run.episodes),
        css=files.joinpath("page.css").read_text(encoding="utf-8"),
        js=files.joinpath("page.js").read_text(encoding="utf-8"),
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(html)
    os.replace(tmp, out)
    return out


def script_json(value) -> str:
    """`value` as JSON that is safe inside <script type="application/json">: no '<', '>' or '&'
    (so no "</script>" or "<!--" in model output can end or bend the element) and no NaN, which
    JSON.parse rejects."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(value), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
