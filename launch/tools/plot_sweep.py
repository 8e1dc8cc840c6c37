#!/usr/bin/python3
"""plot_sweep.py SWEEP: draws a keel-sweep directory's results into SWEEP/plots/.

Reads SWEEP/sweep.csv (launch/tools/keel-sweep), SWEEP/sweep.json (for ln vocab, the loss of a uniform
prediction) and, for the per-step plots, SWEEP/runs/NAME/metrics.jsonl and alerts.jsonl. Writes:

  final_loss_vs_lr.png      (a) final loss against the peak learning rate, one curve per
                            (qk_norm, z_loss) setting; diverged runs are crosses at ln vocab
  attn_logit_steps.png      (b) max attention logit over the steps, qk_norm NONE at its highest
                            stable and first unstable learning rate (solid, dashed), and every
                            other QK-norm mode of the sweep at the same two learning rates
  guard_run.png             (c) the guard arm's loss with its spike, rewind and skip alerts
                            (launch/tools/plot_run.py's drawing), when the sweep ran the arm
  max_attn_logit_vs_lr.png  the largest attention logit of each run against the learning rate
  log_z_vs_lr.png           the final mean log Z (output-logit scale) against the learning rate

"Stable" means not unstable (keel-sweep's definition: not diverged and within --unstable-margin of
its setting's best final loss); when NONE is unstable nowhere, (b) uses its two highest learning
rates and says so. In (a) and the per-lr plots, crosses are diverged runs and open circles runs
that are unstable without diverging. A run whose metrics are missing (a committed example
keeps only the runs the plots need) is left out of (b), said once. One line per PNG:
    plot_sweep: wrote SWEEP/plots/final_loss_vs_lr.png (runs=57 settings=8 diverged=9)

Exit codes: 0 done; 2 bad usage or no sweep.csv rows (one line on stderr); 3 matplotlib is not
installed. Headless (Agg backend).
"""
import csv
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_run  # noqa: E402  (its JSON-lines reader and run drawing)

PROG = "plot_sweep"
QK_COLORS = {"NONE": "tab:red", "RMS": "tab:blue", "LAYER": "tab:green", "L2": "tab:purple"}


def num(text):
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def read_sweep(path):
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f):
            if num(r.get("lr")) is None or not r.get("qk_norm"):
                continue
            rows.append(r)
    return rows


def settings(rows):
    """(qk_norm, z_loss) pairs of the grid rows in first-seen order."""
    seen = []
    for r in rows:
        key = (r["qk_norm"], num(r["z_loss"]))
        if r.get("guard") != "on" and key not in seen:
            seen.append(key)
    return seen


def style(qk, z, z_values):
    # Solid: the largest z-loss of the sweep (z-loss on); dashed: smaller (off).
    ls = "-" if z == max(z_values) else "--"
    return QK_COLORS.get(qk, "gray"), ls


def per_lr_plot(plt, path, rows, l0, key, title, ylabel, log_y):
    grid = [r for r in rows if r.get("guard") != "on"]
    z_values = sorted({num(r["z_loss"]) for r in grid})
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    diverged = 0
    for qk, z in settings(grid):
        pts = sorted(((num(r["lr"]), r) for r in grid
                      if r["qk_norm"] == qk and num(r["z_loss"]) == z), key=lambda p: p[0])
        color, ls = style(qk, z, z_values)
        xs, ys, dx, dy, ux, uy = [], [], [], [], [], []
        for lr, r in pts:
            bad = r.get("diverged") == "1"
            diverged += bad
            v = num(r.get(key))
            if key == "final_loss":
                v = l0 if bad or v is None else min(v, l0)
            if v is None or (log_y and v <= 0):
                continue
            xs.append(lr)
            ys.append(v)
            if bad:
                dx.append(lr)
                dy.append(v)
            elif is_unstable(r):
                ux.append(lr)
                uy.append(v)
        ax.plot(xs, ys, color=color, ls=ls, marker="o", ms=4, lw=1.4,
                label="qk_norm %s, z_loss %g" % (qk, z))
        if dx:
            ax.scatter(dx, dy, color=color, marker="x", s=70, zorder=5)
        if ux:
            ax.scatter(ux, uy, facecolors="none", edgecolors=color, marker="o", s=90, zorder=5)
    if key == "final_loss":
        ax.axhline(l0, color="gray", lw=0.8, ls=":", label="ln vocab (uniform prediction)")
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel(ylabel)
    ax.set_title(title + " (x: diverged, o: unstable)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    plot_run.save_png(fig, plt, path)
    return len(grid), len(settings(grid)), diverged


def is_unstable(r):
    return r.get("unstable", r.get("diverged")) == "1"


def pick_lrs(grid):
    """(highest stable lr, first unstable lr, note) for qk_norm NONE at the largest z_loss."""
    none = [r for r in grid if r["qk_norm"] == "NONE"]
    if not none:
        return None, None, "no qk_norm NONE runs"
    z = max(num(r["z_loss"]) for r in none)
    runs = sorted((num(r["lr"]), is_unstable(r)) for r in none if num(r["z_loss"]) == z)
    unstable = [lr for lr, bad in runs if bad]
    if unstable:
        first = unstable[0]
        stable = [lr for lr, bad in runs if not bad and lr < first]
        return (stable[-1] if stable else None), first, ""
    lrs = [lr for lr, _ in runs]
    return (lrs[-2] if len(lrs) > 1 else None), lrs[-1], "NONE unstable nowhere: its two highest"


def attn_steps_plot(plt, path, sweep, rows):
    grid = [r for r in rows if r.get("guard") != "on"]
    stable, unstable, note = pick_lrs(grid)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    drawn, missing = 0, []
    z_none = max([num(r["z_loss"]) for r in grid if r["qk_norm"] == "NONE"] or [0.0])
    for lr, ls, which in ((stable, "-", "highest stable"), (unstable, "--", "first unstable")):
        if lr is None:
            continue
        for r in grid:
            if num(r["lr"]) != lr or num(r["z_loss"]) != z_none:
                continue
            mpath = os.path.join(sweep, "runs", r["name"], "metrics.jsonl")
            if not os.path.isfile(mpath):
                missing.append(r["name"])
                continue
            pts = [(m["step"], plot_run.finite(m.get("max_attn_logit")))
                   for m in plot_run.read_jsonl(mpath)]
            pts = [(s, v) for s, v in pts if v is not None and v > 0]
            if not pts:
                continue
            qk = r["qk_norm"]
            ax.plot(*zip(*pts), color=QK_COLORS.get(qk, "gray"), ls=ls,
                    lw=2.0 if qk == "NONE" else 1.0,
                    label="%s, lr %g (%s for NONE)" % (qk, lr, which))
            drawn += 1
    if missing:
        print("%s: no metrics for %s: left out of %s" % (PROG, ", ".join(missing), path),
              file=sys.stderr)
    if not drawn:
        ax.text(0.5, 0.5, "no runs to draw", transform=ax.transAxes, ha="center")
    else:
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="best")
    ax.set_xlabel("step")
    ax.set_ylabel("max |scaled q.k| of the step")
    ax.set_title("max attention logit, z_loss %g%s" % (z_none, (" (" + note + ")") if note else ""))
    ax.grid(True, alpha=0.3, which="both")
    plot_run.save_png(fig, plt, path)
    return drawn, stable, unstable


def guard_plot(plt, path, sweep, rows):
    arm = [r for r in rows if r.get("guard") == "on"]
    if not arm:
        return None
    run = os.path.join(sweep, "runs", arm[0]["name"])
    mpath = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(mpath):
        print("%s: no metrics for the guard arm %s: %s not drawn" % (PROG, arm[0]["name"], path),
              file=sys.stderr)
        return None
    metrics = plot_run.read_jsonl(mpath)
    apath = os.path.join(run, "alerts.jsonl")
    alerts = plot_run.read_jsonl(apath) if os.path.isfile(apath) else []
    segments = plot_run.split_segments(metrics)
    jumps = plot_run.rewind_jumps(segments, alerts)
    title = "spike guard on: qk_norm NONE, lr %s, z_loss %s (%s)" % (
        arm[0]["lr"], arm[0]["z_loss"], "halted" if arm[0].get("halted") == "1" else "finished")
    points = plot_run.draw(plt, path, title, ["loss", "val_loss"], "nats/token", segments,
                           alerts, jumps, "loss")
    return points, len(alerts), len(jumps)


def main(argv):
    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: plot_sweep.py SWEEP  (draws SWEEP/sweep.csv into SWEEP/plots/)",
              file=sys.stderr)
        return 2
    sweep = argv[1]
    csv_path = os.path.join(sweep, "sweep.csv")
    if not os.path.isfile(csv_path):
        print("%s: no sweep.csv in %s: nothing to plot" % (PROG, sweep), file=sys.stderr)
        return 2
    rows = read_sweep(csv_path)
    if not rows:
        print("%s: %s has no runs: nothing to plot" % (PROG, csv_path), file=sys.stderr)
        return 2
    vocab = 256
    try:
        with open(os.path.join(sweep, "sweep.json"), encoding="utf-8") as f:
            vocab = int(json.load(f).get("vocab", vocab))
    except (OSError, ValueError, TypeError):
        print("%s: %s/sweep.json unreadable: assuming vocab 256" % (PROG, sweep), file=sys.stderr)
    l0 = math.log(vocab)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print("%s: matplotlib is not installed (%s; apt-get install python3-matplotlib): no plots "
              "drawn" % (PROG, e), file=sys.stderr)
        return 3
    out = os.path.join(sweep, "plots")
    os.makedirs(out, exist_ok=True)

    path = os.path.join(out, "final_loss_vs_lr.png")
    n, s, d = per_lr_plot(plt, path, rows, l0, "final_loss", "final validation loss",
                          "nats/token (capped at ln vocab)", False)
    print("%s: wrote %s (runs=%d settings=%d diverged=%d)" % (PROG, path, n, s, d))
    path = os.path.join(out, "attn_logit_steps.png")
    drawn, stable, unstable = attn_steps_plot(plt, path, sweep, rows)
    print("%s: wrote %s (curves=%d stable_lr=%s unstable_lr=%s)" % (
        PROG, path, drawn, "%g" % stable if stable else "-", "%g" % unstable if unstable else "-"))
    path = os.path.join(out, "guard_run.png")
    g = guard_plot(plt, path, sweep, rows)
    if g:
        print("%s: wrote %s (points=%d alerts=%d rewinds=%d)" % ((PROG, path) + g))
    path = os.path.join(out, "max_attn_logit_vs_lr.png")
    n, s, d = per_lr_plot(plt, path, rows, l0, "max_attn_logit",
                          "largest attention logit of the run", "max |scaled q.k|", True)
    print("%s: wrote %s (runs=%d settings=%d diverged=%d)" % (PROG, path, n, s, d))
    path = os.path.join(out, "log_z_vs_lr.png")
    n, s, d = per_lr_plot(plt, path, rows, l0, "log_z", "final mean log Z (output-logit scale)",
                          "mean logsumexp(logits)", False)
    print("%s: wrote %s (runs=%d settings=%d diverged=%d)" % (PROG, path, n, s, d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
