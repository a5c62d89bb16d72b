"""Renders every panel of the Grafana dashboard to a PNG from a real
Prometheus: what Grafana would draw, without Grafana (not in Debian).

  render_dashboard.py --prometheus=http://HOST:PORT --dashboard=pdworker.json \
      --out_dir=DIR [--minutes=10] [--rate_interval=10s]

tests/deploy/promql_test imports it and calls render() after its traffic,
writing into $TEST_UNDECLARED_OUTPUTS_DIR (Bazel zips that directory into
bazel-testlogs/tests/deploy/promql_test/test.outputs/outputs.zip).

One PNG per panel, named <NN>_<title>.png in dashboard order, drawn with
Debian's python3-matplotlib (Agg, no display):
- timeseries: every target through /api/v1/query_range, one line per series
  labelled by the target's legendFormat, the panel's unit on the y axis (an
  override's unit on a right-hand axis, as Grafana places it), and a legend
  table with the last and mean values, as the dashboard's legends show;
- stat: the last value of each series, formatted with the unit;
- table: the instant query's rows, with the panel's column order and names
  (its "organize" transformation).
Grafana's variables are substituted as the dashboard's defaults select:
every role and instance.
"""
import argparse
import json
import math
import os
import re
import textwrap
import time
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

ALL = ".*"


def substitute(expr, rate_interval, range_, variables=None):
    """Grafana's substitution: the interval and range, and every template
    variable as `variables` sets it (default: all values, ".*")."""
    values = {"role": ALL, "instance": ALL, **(variables or {})}
    for k, v in (("$__rate_interval", rate_interval), ("$__interval", rate_interval),
                 ("$__range", range_)):
        expr = expr.replace(k, v)
    for name, v in values.items():
        expr = expr.replace("$" + name, v)
    if "$" in expr:
        raise ValueError(f"unsubstituted Grafana variable in {expr}")
    return expr


# ------------------------------------------------------------------ units

def _scaled(v, steps, unit_suffix=""):
    """v scaled by the first (factor, suffix) whose factor it reaches."""
    for factor, suffix in steps:
        if abs(v) >= factor:
            return f"{v / factor:.3g} {suffix}{unit_suffix}".rstrip()
    factor, suffix = steps[-1]
    return f"{v / factor:.3g} {suffix}{unit_suffix}".rstrip()


SI = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")]
IEC = [(2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")]


def format_value(v, unit):
    """A value as Grafana shows it for the unit (the subset the dashboard
    uses: s, percentunit, short, ops, reqps, Bps, bytes)."""
    if v is None or not math.isfinite(v):
        return "no data"
    if v == 0:
        return {"s": "0 s", "percentunit": "0%", "ops": "0 ops/s", "reqps": "0 req/s",
                "Bps": "0 B/s", "bytes": "0 B"}.get(unit, "0")
    if unit == "s":
        return _scaled(v, [(3600, "h"), (60, "min"), (1, "s"), (1e-3, "ms"), (1e-6, "µs"),
                           (1e-9, "ns")])
    if unit == "percentunit":
        return f"{v * 100:.3g}%"
    if unit == "ops":
        return _scaled(v, SI, "ops/s")
    if unit == "reqps":
        return _scaled(v, SI, "req/s")
    if unit == "Bps":
        return _scaled(v, [(1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")], "B/s")
    if unit == "bytes":
        return _scaled(v, IEC)
    return _scaled(v, SI)


def legend_name(fmt, labels, expr):
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" \
            if labels else expr[:40]
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


# ------------------------------------------------------------- prometheus

class Prometheus:
    def __init__(self, url):
        self.url = url.rstrip("/")

    def _get(self, path, params):
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read().decode())
        if body["status"] != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]["result"]

    def query_range(self, expr, start, end, step):
        return self._get("/api/v1/query_range",
                         {"query": expr, "start": start, "end": end, "step": step})

    def query(self, expr, at):
        return self._get("/api/v1/query", {"query": expr, "time": at})


# ----------------------------------------------------------------- panels

def panels_in_order(dashboard):
    """Non-row panels (rows' nested ones too), sorted as Grafana lays them
    out: by y, then x."""
    out = []

    def walk(ps):
        for p in ps:
            if p["type"] != "row":
                out.append(p)
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    return sorted(out, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def slug(title):
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def _figure(panel, row, width_in, body_in):
    """A figure with the panel's title and description on top; returns
    (figure, the fraction of its height left below the header, inches to
    figure fraction)."""
    lines = textwrap.wrap(panel.get("description", ""), int(width_in * 15))
    header_in = 0.45 + 0.14 * len(lines)
    height_in = header_in + body_in
    fig = plt.figure(figsize=(width_in, height_in), dpi=100)
    fig.text(0.01, 1 - 0.12 / height_in, f"{row} / {panel['title']}" if row else panel["title"],
             fontsize=12, fontweight="bold", va="top", ha="left")
    fig.text(0.01, 1 - 0.40 / height_in, "\n".join(lines), fontsize=7.5, va="top", ha="left",
             color="#444444", linespacing=1.3)
    return fig, body_in / height_in, 1 / height_in


def regex_matcher(pattern):
    """Grafana's byRegexp: /re/flags, or a bare pattern matching the whole
    display name."""
    m = re.fullmatch(r"/(.*)/([a-z]*)", pattern)
    if m:
        rx = re.compile(m.group(1), re.I if "i" in m.group(2) else 0)
        return lambda name: rx.search(name) is not None
    rx = re.compile(pattern)
    return lambda name: rx.fullmatch(name) is not None


def field_config(panel, name, ref):
    """The panel's field config defaults with the overrides that match a
    series (by frame refId, display name, or display-name regex) applied:
    {"unit", "right", "stacking": (mode, group)}."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    stacking = custom.get("stacking", {"mode": "none", "group": "A"})
    cfg = {"unit": defaults.get("unit", "short"),
           "right": custom.get("axisPlacement") == "right",
           "stacking": (stacking.get("mode", "none"), stacking.get("group", "A"))}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        kind, option = o["matcher"]["id"], o["matcher"]["options"]
        if not ((kind == "byFrameRefID" and option == ref)
                or (kind == "byName" and option == name)
                or (kind == "byRegexp" and regex_matcher(option)(name))):
            continue
        for prop in o["properties"]:
            if prop["id"] == "unit":
                cfg["unit"] = prop["value"]
            elif prop["id"] == "custom.axisPlacement":
                cfg["right"] = prop["value"] == "right"
            elif prop["id"] == "custom.stacking":
                cfg["stacking"] = (prop["value"].get("mode", "none"),
                                   prop["value"].get("group", "A"))
    return cfg


# Grafana's legend sortBy names -> the row field.
LEGEND_CALCS = {"Mean": "mean", "Last *": "last", "Last": "last", "Name": "name"}


def render_timeseries(panel, prom, window, subst, path, row):
    start, end, step = window
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    series = []  # {name, cfg, times, values}
    for t in panel["targets"]:
        expr = subst(t["expr"])
        for s in prom.query_range(expr, start, end, step):
            name = legend_name(t.get("legendFormat", ""), s["metric"], expr)
            series.append({"name": name, "cfg": field_config(panel, name, t["refId"]),
                           "times": [float(v[0]) - start for v in s["values"]],
                           "values": [float(v[1]) for v in s["values"]]})
    for s in series:
        finite = [v for v in s["values"] if math.isfinite(v)]
        s["last"] = finite[-1] if finite else None
        s["mean"] = sum(finite) / len(finite) if finite else None
        s["zero"] = not any(finite)
    # The legend as Grafana's "table" legend (name, last, mean), sorted as
    # the panel says (else in query order); colours by legend rank, so the
    # rows that fit get the distinct ones.
    legend = panel.get("options", {}).get("legend", {})
    rows = [s for s in series if s["last"] is not None]
    field = LEGEND_CALCS.get(legend.get("sortBy"))
    if field:
        rows.sort(key=lambda s: s[field], reverse=bool(legend.get("sortDesc")))
    rows += [s for s in series if s["last"] is None]  # no data: last
    palette = plt.get_cmap("tab10").colors
    for i, s in enumerate(rows):
        s["color"] = palette[i] if i < len(palette) else "#999999"

    legend_rows = min(len(series), 14)
    legend_in = 0.3 + 0.22 * legend_rows
    fig, body, per_in = _figure(panel, row, 11, 4.0 + legend_in)
    legend_h = legend_in * per_in
    right_units = sorted({s["cfg"]["unit"] for s in series if s["cfg"]["right"]})
    ax = fig.add_axes([0.09, legend_h + 0.55 * per_in, 0.80 if right_units else 0.88,
                       body - legend_h - 0.65 * per_in])
    ax2 = ax.twinx() if right_units else None
    bars = custom.get("drawStyle") == "bars"
    stacks = {}  # (axis, group) -> running totals per timestamp
    finite_points = 0
    for s in series:
        target_ax = ax2 if s["cfg"]["right"] else ax
        values = s["values"]
        mode, group = s["cfg"]["stacking"]
        base = None
        if mode == "normal":
            key = (id(target_ax), group)
            base = stacks.get(key, {})
            top = {t: base.get(t, 0.0) + (v if math.isfinite(v) else 0.0)
                   for t, v in zip(s["times"], values)}
            stacks[key] = {**base, **top}
            bottom = [base.get(t, 0.0) for t in s["times"]]
            values = [top[t] for t in s["times"]]
        if bars:
            target_ax.bar(s["times"], [v - b for v, b in zip(values, bottom)] if base is not None
                          else values, width=step * 0.9,
                          bottom=bottom if base is not None else None, color=s["color"],
                          alpha=0.8)
        else:
            target_ax.plot(s["times"], values, "--" if s["cfg"]["right"] else "-",
                           color=s["color"], linewidth=1.4)
            if base is not None:
                target_ax.fill_between(s["times"], bottom, values, color=s["color"], alpha=0.3)
        finite_points += sum(1 for v in s["values"] if math.isfinite(v))
    ax.set_xlim(0, end - start)
    ax.set_xlabel("seconds since the first scrape")
    ax.grid(True, alpha=0.3)
    ax.set_ylabel(custom.get("axisLabel", ""))
    unit = defaults.get("unit", "short")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    scale = custom.get("scaleDistribution", {})
    if scale.get("type") == "log":
        ax.set_yscale("log", base=scale.get("log", 10))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    elif "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"] * 1.02)
    if ax2 is not None:
        right_unit = right_units[0]
        ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, right_unit)))
        ax2.set_ylim(bottom=0)
    if not series:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center",
                fontsize=20, color="#aa0000")
    lax = fig.add_axes([0.09, 0.005, 0.86, legend_h])
    lax.axis("off")
    if rows:
        shown = rows[:legend_rows]
        table = lax.table(
            cellText=[[s["name"] + ("  (right axis)" if s["cfg"]["right"] else ""),
                       format_value(s["last"], s["cfg"]["unit"]),
                       format_value(s["mean"], s["cfg"]["unit"])] for s in shown],
            colLabels=["series", "last", "mean"], colWidths=[0.64, 0.18, 0.18],
            cellLoc="left", bbox=[0, 1 - (len(shown) + 1) / (legend_rows + 1.5), 1,
                                  (len(shown) + 1) / (legend_rows + 1.5)])
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        for k, s in enumerate(shown, start=1):
            table[k, 0].get_text().set_color(s["color"])
            table[k, 0].get_text().set_fontweight("bold")
        hidden = rows[len(shown):]
        if hidden:
            zeros = sum(1 for s in hidden if s["zero"])
            lax.text(0, 0, f"... and {len(hidden)} more series ({zeros} of them 0 throughout)",
                     fontsize=8, transform=lax.transAxes)
    fig.savefig(path)
    plt.close(fig)
    return {"series": len(series), "finite_points": finite_points}


def threshold_color(defaults, v):
    steps = defaults.get("thresholds", {}).get("steps", [])
    color = "black"
    for step in steps:
        if step["value"] is None or (v is not None and v >= step["value"]):
            color = {"green": "#1a7f37", "orange": "#d97706", "red": "#c62828"}.get(
                step["color"], step["color"])
    return color if steps else "black"


def render_stat(panel, prom, window, subst, path, row):
    start, end, step = window
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit", "short")
    values = []
    for t in panel["targets"]:
        expr = subst(t["expr"])
        for s in prom.query_range(expr, start, end, step):
            points = [(float(v[0]) - start, float(v[1])) for v in s["values"]]
            finite = [v for _, v in points if math.isfinite(v)]
            values.append((legend_name(t.get("legendFormat", ""), s["metric"], expr),
                           finite[-1] if finite else None, points))
    fig, body, _ = _figure(panel, row, 8, 2.4)
    if not values:
        fig.text(0.5, body * 0.5, "No data", ha="center", fontsize=24, color="#aa0000")
    graph = panel.get("options", {}).get("graphMode") == "area"
    for i, (name, v, points) in enumerate(values):
        x = (i + 0.5) / len(values)
        color = threshold_color(defaults, v)
        fig.text(x, body * 0.55, format_value(v, unit), ha="center", fontsize=26,
                 fontweight="bold", color=color)
        fig.text(x, body * 0.40, name, ha="center", fontsize=10)
        if graph and points:
            # Grafana's sparkline under the value: the whole range.
            spark = fig.add_axes([i / len(values) + 0.03, 0.03, 1 / len(values) - 0.06,
                                  body * 0.30])
            spark.fill_between([t for t, _ in points], [y for _, y in points], alpha=0.3,
                               color=color)
            spark.plot([t for t, _ in points], [y for _, y in points], color=color,
                       linewidth=1)
            spark.set_xlim(0, end - start)
            spark.axis("off")
    fig.savefig(path)
    plt.close(fig)
    finite = [v for _, v, _ in values if v is not None]
    return {"series": len(values), "finite_points": len(finite)}


def render_table(panel, prom, window, subst, path, row):
    start, end, _ = window
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    organize = {}
    for tr in panel.get("transformations", []):
        if tr["id"] == "organize":
            organize = tr["options"]
    rows = []
    for t in panel["targets"]:
        expr = subst(t["expr"])
        for s in prom.query(expr, end):
            r = dict(s["metric"])
            r["Value"] = s["value"][1]
            rows.append(r)
    index = organize.get("indexByName", {})
    columns = sorted({k for r in rows for k in r} - set(organize.get("excludeByName", {})),
                     key=lambda c: (index.get(c, len(index)), c))
    rename = organize.get("renameByName", {})
    sort_by = panel.get("options", {}).get("sortBy", [])
    if sort_by:
        key = {rename.get(c, c): c for c in columns}.get(sort_by[0]["displayName"])
        if key:
            def sort_key(r):
                try:
                    return (0, float(r.get(key, "")))
                except ValueError:
                    return (1, r.get(key, ""))
            rows.sort(key=sort_key, reverse=sort_by[0].get("desc", False))
    rows = rows[:25]
    fig, body, _ = _figure(panel, row, 12, 0.3 + 0.25 * (len(rows) + 1))
    ax = fig.add_axes([0.01, 0.01, 0.98, body - 0.02])
    ax.axis("off")
    decimals = defaults.get("decimals")

    def cell(r, c):
        v = r.get(c, "")
        if c == "Value":
            try:
                f = float(v)
            except ValueError:
                return v
            return f"{f:.{decimals}f}" if decimals is not None else f"{f:.4g}"
        return v if len(v) <= 48 else v[:22] + "..." + v[-22:]
    if rows:
        text = [[cell(r, c) for c in columns] for r in rows]
        labels = [rename.get(c, c) for c in columns]
        # Columns as wide as their longest text (Grafana sizes them so too).
        widths = [max([len(labels[j])] + [len(t[j]) for t in text]) + 2
                  for j in range(len(columns))]
        table = ax.table(cellText=text, colLabels=labels, cellLoc="left", bbox=[0, 0, 1, 1],
                         colWidths=[w / sum(widths) for w in widths])
        table.auto_set_font_size(False)
        table.set_fontsize(8)
    else:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", fontsize=20, color="#aa0000")
    fig.savefig(path)
    plt.close(fig)
    return {"series": len(rows), "finite_points": len(rows)}


RENDERERS = {"timeseries": render_timeseries, "stat": render_stat, "table": render_table}


def variable_values(dashboard, name, prom, at):
    """A query variable's values now (label_values(expr, label) as
    `count by (label) (expr)`), the other variables at their defaults."""
    (v,) = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip(), re.S)
    if not m:
        raise ValueError(f"variable {name}: unsupported query {q}")
    expr = substitute(m.group(1), "1m", "1m")
    return sorted(s["metric"][m.group(2)]
                  for s in prom.query(f"count by ({m.group(2)}) ({expr})", at))


def render(dashboard, prometheus_url, out_dir, start, end, step=1.0, rate_interval="10s"):
    """One PNG per panel for [start, end] (unix seconds); a panel repeated
    by a variable (Grafana's "repeat") gives one per value. Returns one
    {"id", "title", "path", "series", "finite_points"} per PNG, in order."""
    prom = Prometheus(prometheus_url)
    os.makedirs(out_dir, exist_ok=True)
    rows_by_y = sorted((p["gridPos"]["y"], p["title"]) for p in dashboard["panels"]
                       if p["type"] == "row")
    range_ = f"{int(end - start)}s"
    out = []
    for i, panel in enumerate(panels_in_order(dashboard), start=1):
        row = ""
        for y, title in rows_by_y:
            if y < panel["gridPos"]["y"]:
                row = title
        copies = [("", {})]
        if panel.get("repeat"):
            var = panel["repeat"]
            copies = [(f"_{var}_{v}", {var: re.escape(v)})
                      for v in variable_values(dashboard, var, prom, end)]
        for suffix, variables in copies:
            path = os.path.join(out_dir, f"{i:02d}_{slug(panel['title'])}{suffix}.png")
            shown = dict(panel, title=panel["title"] + (
                " (" + ", ".join(f"${k} = {v}" for k, v in variables.items()) + ")"
                if variables else ""))
            result = RENDERERS[panel["type"]](
                shown, prom, (start, end, step),
                lambda e, variables=variables: substitute(e, rate_interval, range_, variables),
                path, row)
            out.append(dict(result, id=panel["id"], title=shown["title"], path=path))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--dashboard", required=True)
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate_interval", default="10s")
    args = parser.parse_args()
    with open(args.dashboard) as f:
        dashboard = json.load(f)
    end = time.time()
    results = render(dashboard, args.prometheus, args.out_dir, end - 60 * args.minutes, end,
                     step=max(1.0, args.minutes * 60 / 600), rate_interval=args.rate_interval)
    for r in results:
        print(f"{r['path']}: {r['series']} series, {r['finite_points']} points")


if __name__ == "__main__":
    main()
