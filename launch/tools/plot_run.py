#!/usr/bin/python3
"""plot_run.py RUN: draws a keel run's metrics, with its spike-guard alerts, into RUN/plots/.

Reads RUN/metrics.jsonl (one object per logged step: step, loss, z_loss, grad_norm, lr,
tokens_per_s, max_attn_logit, sometimes val_loss; null, NaN or a missing key is a gap) and
RUN/alerts.jsonl when there is one (docs/alerts.md). Writes loss.png (loss and val_loss),
grad_norm.png (log scale when every value is positive), lr.png and max_attn_logit.png, and
prints one line per PNG:
    plot_run: wrote RUN/plots/loss.png (points=70 segments=2 alerts=4 rewinds=1)
Every alert is a vertical line at its step, colored by kind (its loss or gradient norm, when
finite, is also marked on those plots). A rewind sends the run back to an earlier step, which it
then logs again, so metrics.jsonl holds repeated steps: the lines are cut into segments where the
step goes back, drawn in file order; the steps a later segment redoes are drawn faded, a dotted
line joins each segment to the next, and an arrow along the top runs from the rewind's step back
to the step it restored.

Exit codes: 0 done; 2 bad usage, or no metrics in RUN (one line on stderr); 3 matplotlib is not
installed (one line; keel-train then skips the plots quietly). Uses Debian's python3-matplotlib
(launch/setup.sh) with the Agg backend, so it needs no display.
"""
import json
import math
import os
import sys

PROG = "plot_run"

# (file, title, series keys, y label)
PLOTS = [
    ("loss.png", "loss", ["loss", "val_loss"], "nats/token"),
    ("grad_norm.png", "gradient norm (before clipping)", ["grad_norm"], "global L2 norm"),
    ("lr.png", "learning rate", ["lr"], "lr"),
    ("max_attn_logit.png", "max attention logit", ["max_attn_logit"], "logit"),
]
SERIES_COLORS = {"val_loss": "tab:orange"}
# Which alert field is marked on which plot.
ALERT_VALUE = {"loss.png": "loss", "grad_norm.png": "grad_norm"}
KIND_COLORS = {
    "nonfinite_loss": "red",
    "nonfinite_grad": "darkred",
    "loss_spike": "darkorange",
    "grad_spike": "purple",
    "rewind": "tab:blue",
    "cannot_rewind": "magenta",
    "halt": "black",
}
OTHER_KIND_COLOR = "gray"
FADED_ALPHA = 0.3


def read_jsonl(path):
    """The objects of a JSON-lines file; a line that is not an object is skipped, said once."""
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("step"), int):
                rows.append(obj)
            else:
                bad += 1
    if bad:
        print("%s: %s: skipped %d unreadable line(s)" % (PROG, path, bad), file=sys.stderr)
    return rows


def finite(v):
    """v as a float when it is a finite number, else None (null, NaN, infinities, strings)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def split_segments(rows):
    """Cuts rows (file order) where the step does not increase: one segment per stretch."""
    segments = []
    for row in rows:
        if not segments or row["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(row)
    return segments


def redo_cuts(segments):
    """For each segment, the first step a later segment logs again (None: nothing redone)."""
    cuts, later_min = [None] * len(segments), None
    for i in range(len(segments) - 1, -1, -1):
        cuts[i] = later_min
        first = segments[i][0]["step"]
        later_min = first if later_min is None else min(later_min, first)
    return cuts


def rewind_jumps(segments, alerts):
    """(from_step, to_step, from_alert) for every jump back: each rewind alert with rewound_to,
    and each segment boundary that no such alert explains."""
    jumps = []
    for a in alerts:
        if a.get("kind") == "rewind" and isinstance(a.get("rewound_to"), int):
            jumps.append((a["step"], a["rewound_to"], True))
    for prev, nxt in zip(segments, segments[1:]):
        back_to = nxt[0]["step"] - 1
        # A rewind from step frm to step to explains the boundary when the next segment starts
        # after `to` (at to + 1, or at the next multiple of train.log_every) and not after frm.
        explained = any(
            from_alert and to <= back_to < frm <= prev[-1]["step"] + 1
            for frm, to, from_alert in jumps
        )
        if not explained:
            jumps.append((prev[-1]["step"], back_to, False))
    return jumps


def draw(plt, out_path, title, keys, ylabel, segments, alerts, jumps, alert_value):
    """Draws one PNG; returns the number of finite points drawn."""
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    cuts = redo_cuts(segments)
    points, all_values = 0, []
    for k, key in enumerate(keys):
        color = SERIES_COLORS.get(key, "tab:blue" if k == 0 else "C%d" % (k + 1))
        marker = "o" if key == "val_loss" else None
        labelled = faded_labelled = False
        prev_end = None
        for seg, cut in zip(segments, cuts):
            # A row without the key was not measured (val_loss off its eval steps): skipped. A
            # null or non-finite value is a gap: NaN breaks the line there.
            pts = [(r["step"], finite(r[key])) for r in seg if key in r]
            pts = [(x, math.nan if y is None else y) for x, y in pts]
            good = [(x, y) for x, y in pts if not math.isnan(y)]
            if not good:
                continue
            points += len(good)
            all_values += [y for _, y in good]
            kept = [p for p in pts if cut is None or p[0] < cut]
            redone = [p for p in pts if cut is not None and p[0] >= cut]
            if kept:
                ax.plot(*zip(*kept), color=color, lw=1.2, marker=marker, ms=3,
                        label=None if labelled else key)
                labelled = True
            if redone:
                # Join the faded part to the last kept point so the line stays continuous.
                faded = kept[-1:] + redone
                ax.plot(*zip(*faded), color=color, lw=1.0, alpha=FADED_ALPHA, marker=marker,
                        ms=3, label=None if faded_labelled else key + " (redone after a rewind)")
                faded_labelled = True
            if prev_end is not None:
                # The jump back: from where the last segment ended to where this one starts.
                ax.plot([prev_end[0], good[0][0]], [prev_end[1], good[0][1]], color=color,
                        lw=0.8, ls=":", alpha=0.7)
            prev_end = good[-1]
    if all_values and key_is_log(keys, all_values):
        ax.set_yscale("log")

    # Alerts: one vertical-line collection per kind (one legend entry each).
    by_kind = {}
    for a in alerts:
        by_kind.setdefault(a.get("kind") or "?", []).append(a)
    for kind, group in sorted(by_kind.items()):
        color = KIND_COLORS.get(kind, OTHER_KIND_COLOR)
        ax.vlines([a["step"] for a in group], 0, 1, transform=ax.get_xaxis_transform(),
                  colors=color, lw=1.0, alpha=0.6, label="alert: %s (%d)" % (kind, len(group)))
        if alert_value:
            marks = [(a["step"], finite(a.get(alert_value))) for a in group]
            marks = [(x, y) for x, y in marks if y is not None and (ax.get_yscale() != "log"
                                                                    or y > 0)]
            if marks:
                ax.scatter(*zip(*marks), color=color, marker="x", s=40, zorder=5)

    # Rewinds: an arrow along the top from the rewind's step back to the restored step.
    for i, (frm, to, from_alert) in enumerate(jumps):
        color = KIND_COLORS["rewind"] if from_alert else OTHER_KIND_COLOR
        y = 0.95 - 0.05 * (i % 4)  # stagger overlapping arrows
        ax.annotate("", xy=(to, y), xytext=(frm, y), xycoords=ax.get_xaxis_transform(),
                    arrowprops=dict(arrowstyle="->", color=color, ls="--", lw=1.3))
        ax.text((frm + to) / 2, y + 0.01, "rewind %d->%d" % (frm, to) if from_alert
                else "back %d->%d" % (frm, to), transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7, color=color)

    if not points:
        ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center", va="center")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper right", fontsize=8)
    save_png(fig, plt, out_path)
    return points


def save_png(fig, plt, out_path):
    """Writes fig to out_path through a temporary name and closes it."""
    fig.tight_layout()
    tmp = out_path + ".tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, out_path)  # a viewer never sees a half-written PNG


def key_is_log(keys, values):
    return keys == ["grad_norm"] and min(values) > 0


def main(argv):
    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: plot_run.py RUN  (draws RUN/metrics.jsonl and RUN/alerts.jsonl into "
              "RUN/plots/)", file=sys.stderr)
        return 2
    run = argv[1]
    metrics_path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        print("%s: no metrics.jsonl in %s: nothing to plot" % (PROG, run), file=sys.stderr)
        return 2
    rows = read_jsonl(metrics_path)
    if not rows:
        print("%s: %s has no metrics lines: nothing to plot" % (PROG, metrics_path),
              file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("%s: matplotlib is not installed (%s; apt-get install python3-matplotlib): no plots "
              "drawn" % (PROG, e), file=sys.stderr)
        return 3
    alerts_path = os.path.join(run, "alerts.jsonl")
    alerts = read_jsonl(alerts_path) if os.path.isfile(alerts_path) else []

    segments = split_segments(rows)
    jumps = rewind_jumps(segments, alerts)
    out_dir = os.path.join(run, "plots")
    os.makedirs(out_dir, exist_ok=True)
    for name, title, keys, ylabel in PLOTS:
        path = os.path.join(out_dir, name)
        points = draw(plt, path, "%s (%s)" % (title, run), keys, ylabel, segments, alerts, jumps,
                      ALERT_VALUE.get(name))
        print("%s: wrote %s (points=%d segments=%d alerts=%d rewinds=%d)"
              % (PROG, path, points, len(segments), len(alerts), len(jumps)))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
