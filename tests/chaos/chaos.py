#!/usr/bin/python3
"""keel's chaos test: one job, restarted over and over with the same command, under faults.

What it does
------------
For each job layout it runs (--jobs; by default one process with synchronous saves, one process
with async saves, `mpiexec -n 2` data-parallel with async saves and `mpiexec -n 2` with
parallel.tp=2 and synchronous saves), it first trains an uninterrupted *reference* run, then
trains the same job again in a second run directory, restarting it with exactly the same command
after every fault, until it exits 0. The faults come from a seeded RNG (--seed; the seed is printed
first, and the same seed replays the same fault plan):

  kill9        kill -9 of one rank (a random one under mpiexec) at a random moment: during a step,
               during a save, or while the process starts and resumes;
  kill9_async  kill -9 of one rank while an async save is in flight (a step_*.tmp exists);
  sigterm      SIGTERM to one rank (graceful stop: the run saves that step and exits 0);
  sigterm2     SIGTERM twice in a row (as srun and slurmstepd both deliver one): the repeat must
               be harmless, the run still saves and exits 0;
  truncate     between two launches, a file of the newest checkpoint (a shard or manifest.pb) is
               truncated;
  bitflip      between two launches, bits of a file of the newest checkpoint are flipped;
  manifest     between two launches, the newest checkpoint's manifest.pb is edited: a byte
               changed, or (as a format-1 manifest, which carries no checksum) a forged step, a
               slice with n = -1, shard_len = 0, a slice's file escaping the directory, an offset
               past the end of its file, or two slices covering the same block.

The job is the issue's tiny model (d_model 64, 2 layers, 4 heads, d_ff 256, seq_len 64, global
batch 8) with checkpoint.every=5 and checkpoint.keep=2 (retention runs), every step logged
(train.log_every=1), one thread per rank, no plots; the spike guard stays on with its defaults.
The fault plan puts every kind in at least once when --faults allows (and a kill -9 and a SIGTERM
into every mpiexec job), the rest drawn at random, and spreads the launch faults over the run's
steps; a corruption is applied before the next launch, once the newest checkpoint has an intact
one before it to fall back to.

Checks (any failure is printed with the job's fault sequence, the launch's command and the last
lines of its output, and makes the run FAIL):
  - every launch ends within its timeout (a hang names the launch); every exit code is the one
    expected for its fault (0 for a run, a SIGTERM and a double SIGTERM; death by SIGKILL for a
    kill -9, mpiexec's 137 under mpiexec); exit 1, "internal error", "terminate called" or a
    stack trace in any output is a failure;
  - every resume starts from the newest intact checkpoint (the one a SIGTERM saved, or after a
    corruption the previous one, with a line saying why the newest is unusable); a checkpoint the
    harness did not corrupt is never called unusable; no launch starts from scratch when a
    checkpoint exists;
  - the finished run's metrics.jsonl holds each step exactly once, in order, and every field but
    tokens_per_s (loss, grad_norm, ...) equals the reference's as exact strings: with no spike
    injected resume is bitwise;
  - the final checkpoint passes `keel-ckpt verify RUN`, its shard files equal the reference's
    byte for byte, no step_*.tmp or step_*.old is left, retention kept at most
    checkpoint.keep + rewind_margin / every + 1 checkpoints, and alerts.jsonl holds no spike,
    nan, rewind, skip or halt event.

Usage
-----
  Short (what the ctest entry chaos.short runs; 30-40 s on an idle 2-core machine):
    tests/chaos/chaos.py --keel-train build/launch/keel-train --keel-ckpt build/launch/keel-ckpt \
        --mpiexec /usr/bin/mpiexec --seed 1 --faults 16 --steps 40
  Long (a soak; the last line printed is one summary line; exit 0 on PASS, 1 on FAIL):
    tests/chaos/chaos.py --faults 100 --steps 5000
  The last line reads, for example,
    chaos: PASS seed=777 jobs=1p-sync,1p-async,dp2-async,tp2-sync faults=30 (kill9=7 ...
        manifest=4) restarts=25 steps=800x4 trained=3291 wall=261s failures=0
  (faults actually injected, by kind; restarts: launches of the chaos runs; trained: steps those
  launches ran, replays included). Without --keel-train/--keel-ckpt the binaries are taken from
  build/launch/ next to this file; without --seed a random seed is drawn and printed.

  Reproduce a failure: the same command with the printed --seed, --faults, --steps, --jobs and
  --kinds. The seed fixes the plan (which faults, in which job, at which steps, which corruption
  of which file); where a signal lands within a step still depends on the machine's timing.
  -v prints one line per launch; --kinds kill9,truncate (say) draws only those kinds, --jobs
  tp2-sync only that layout, to narrow a failure down. Every launch's output is kept in
  WORK/JOB/logs/launch_NNN.{out,err} (000: the reference); --work-dir DIR puts WORK there. WORK is
  deleted after a PASS unless --keep; after a FAIL it is kept and its path printed.
  --time-limit bounds the whole run (ctest's entry sets it below its TIMEOUT so that nothing is
  left running).

The binaries are copied into the work directory first, so a rebuild during the run does not
change them. Only the Python standard library is used (run it with /usr/bin/python3). The steps of
--steps are per job: the long form trains every job to step 5000.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

LAUNCH_KINDS = ["kill9", "kill9_async", "sigterm", "sigterm2"]
DISK_KINDS = ["truncate", "bitflip", "manifest"]
KINDS = LAUNCH_KINDS + DISK_KINDS

# The tiny model of the issue ("S") and what makes every step logged and the run cheap.
BASE_SETS = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=256",
    "model.seq_len=64", "train.global_batch=8", "checkpoint.every=5", "checkpoint.keep=2",
    "train.log_every=1", "train.plot=false", "train.threads=1",
]
EVERY = 5
KEEP = 2
REWIND_MARGIN = 10  # spike.rewind_margin's default: the guard pins checkpoints this far back

JOBS = {
    # name: (ranks, extra --set values, async saves)
    "1p-sync": (1, [], False),
    "1p-async": (1, ["checkpoint.async=true"], True),
    "dp2-async": (2, ["checkpoint.async=true"], True),
    "tp2-sync": (2, ["parallel.tp=2"], False),
}

BAD_OUTPUT = re.compile(
    r"internal error|terminate called|[Bb]acktrace|[Ss]tack trace|Segmentation fault|"
    r"core dumped|AddressSanitizer|UndefinedBehaviorSanitizer|Assertion .* failed")
STEP_LINE = re.compile(rb"^step\s+(\d+)/", re.M)
RESUME_LINE = re.compile(r"resuming from (\S+) at step (\d+)")
UNUSABLE_LINE = re.compile(r"checkpoint (\S+) is unusable: (.*)")
STOPPED_LINE = re.compile(r"stopped by SIG\w+ \(received by rank \d+\) after step (\d+)")
STEP_DIR = re.compile(r"^step_(\d{8})$")


def now():
    return time.monotonic()


def tail(text, n=15):
    lines = text.rstrip("\n").split("\n")
    return "\n".join("    | " + l for l in lines[-n:]) if text.strip() else "    | (empty)"


# --------------------------------------------------------------------------------------------
# Processes


def proc_children_map():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            fields = st.rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def descendants(pid):
    kids = proc_children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except OSError:
        return False


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(kv.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def kill_tree(p):
    pids = descendants(p.pid)
    for sig_target in [p.pid] + pids:
        try:
            os.kill(sig_target, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Checkpoints on disk


def committed(ckdir):
    """step -> path of every committed checkpoint: step_N, or step_N.old when step_N is missing
    (a re-save cut short between its two renames; keel-train puts it back)."""
    out = {}
    try:
        names = os.listdir(ckdir)
    except OSError:
        return out
    for n in names:
        m = STEP_DIR.match(n)
        if m and os.path.isdir(os.path.join(ckdir, n)):
            out[int(m.group(1))] = os.path.join(ckdir, n)
    for n in names:
        if n.endswith(".old") and STEP_DIR.match(n[:-4]):
            s = int(n[5:13])
            if s not in out:
                out[s] = os.path.join(ckdir, n)
    return out


def identity(path):
    """What tells one save of a checkpoint directory from a later one under the same name: the
    directory's and its manifest's inodes and the manifest's mtime (an inode number alone is
    reused when keel-train deletes a corrupt checkpoint and saves that step again)."""
    try:
        d = os.stat(path)
    except OSError:
        return None
    try:
        m = os.stat(os.path.join(path, "manifest.pb"))
        return (d.st_ino, m.st_ino, m.st_mtime_ns)
    except OSError:
        return (d.st_ino, None, None)


# ---- a minimal protobuf wire codec, for the manifest edits --------------------------------


def read_varint(b, i):
    v, shift = 0, 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def write_varint(v):
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while True:
        c = v & 0x7F
        v >>= 7
        if v:
            out.append(c | 0x80)
        else:
            out.append(c)
            return bytes(out)


def pb_decode(b):
    """[(field, wiretype, value)]: value is an int (varint), or bytes (fixed64, fixed32, length)."""
    out, i = [], 0
    while i < len(b):
        key, i = read_varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(b, i)
        elif wt == 1:
            v, i = b[i:i + 8], i + 8
        elif wt == 2:
            n, i = read_varint(b, i)
            v, i = b[i:i + n], i + n
        elif wt == 5:
            v, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        out.append([f, wt, v])
    return out


def pb_encode(fields):
    out = bytearray()
    for f, wt, v in fields:
        out += write_varint((f << 3) | wt)
        if wt == 0:
            out += write_varint(v)
        elif wt == 2:
            out += write_varint(len(v)) + v
        else:
            out += v
    return bytes(out)


def as_format1(fields):
    """The manifest as format 1 (no checksum record): what an old keel wrote, still accepted, so
    only validation can catch what the edit broke."""
    fields = [x for x in fields if x[0] != 15]
    for x in fields:
        if x[0] == 1:
            x[2] = 1
    return fields


def edit_manifest(path, rng, ckdir_steps):
    """Edits manifest.pb in place; returns a description of the edit."""
    with open(path, "rb") as f:
        data = f.read()
    variants = ["byte", "step", "slice_n", "shard_len0", "file_escape", "offset", "overlap"]
    variant = rng.choice(variants)
    try:
        fields = pb_decode(data)
    except (ValueError, IndexError):
        variant = "byte"
    if variant == "overlap":
        # Two slices of one tensor made to cover the same block: the sum of their lengths still
        # matches the tensor's size, only an overlap check catches it. Needs a sharded tensor.
        tensors = [x for x in fields if x[0] == 11]
        rng.shuffle(tensors)
        for t in tensors:
            tf = pb_decode(t[2])
            slices = [x for x in tf if x[0] == 5]
            decoded = [pb_decode(s[2]) for s in slices]
            geo = [{f: v for f, wt, v in d if f in (1, 2, 3, 4, 5)} for d in decoded]
            pairs = [(i, j) for i in range(len(geo)) for j in range(len(geo))
                     if i != j and geo[i] != geo[j] and geo[i].get(5) == geo[j].get(5)
                     and geo[i].get(3) == geo[j].get(3)]
            if not pairs:
                continue
            i, j = rng.choice(pairs)
            keep = [x for x in decoded[j] if x[0] not in (1, 2, 3, 4, 5)]
            overlap = [x for x in decoded[i] if x[0] in (1, 2, 3, 4, 5)] + keep
            slices[j][2] = pb_encode(overlap)
            t[2] = pb_encode(tf)
            name = next((v.decode(errors="replace") for f, wt, v in tf if f == 1), "?")
            with open(path, "wb") as f:
                f.write(pb_encode(as_format1(fields)))
            return f"manifest: slices {i} and {j} of {name} cover the same block (format 1)"
        variant = rng.choice(variants[:-1])
    if variant == "byte":
        off = rng.randrange(len(data))
        new = (data[off] + rng.randrange(1, 256)) % 256
        data = data[:off] + bytes([new]) + data[off + 1:]
        with open(path, "wb") as f:
            f.write(data)
        return f"manifest byte {off} of {len(data)} changed"
    if variant == "step":
        step = next(v for f, wt, v in fields if f == 2)
        choices = [s for s in ckdir_steps if s != step] + [max(0, step - 3), step + 7]
        forged = rng.choice([c for c in choices if c != step])
        for x in fields:
            if x[0] == 2:
                x[2] = forged
        desc = f"manifest step {step} forged to {forged} (format 1)"
    else:
        tensors = [x for x in fields if x[0] == 11]
        t = rng.choice(tensors)
        tf = pb_decode(t[2])
        name = next((v.decode(errors="replace") for f, wt, v in tf if f == 1), "?")
        slices = [x for x in tf if x[0] == 5]
        s = rng.choice(slices)
        sf = pb_decode(s[2])

        def setf(num, wt, value):
            for x in sf:
                if x[0] == num:
                    x[2] = value
                    return
            sf.append([num, wt, value])

        if variant == "slice_n":
            setf(5, 0, -1)
            desc = f"manifest: a slice of {name} has n = -1 (format 1)"
        elif variant == "shard_len0":
            setf(1, 0, 0)
            setf(3, 0, 0)
            desc = f"manifest: a slice of {name} has shard_dim 0, shard_len 0 (format 1)"
        elif variant == "file_escape":
            fname = next((v for f, wt, v in sf if f == 6), b"shard_00000.bin")
            setf(6, 2, b"../../" + fname)
            desc = f"manifest: a slice of {name} reads ../../{fname.decode()} (format 1)"
        else:
            setf(7, 0, 1 << 40)
            desc = f"manifest: a slice of {name} at offset 2^40 (format 1)"
        s[2] = pb_encode(sf)
        t[2] = pb_encode(tf)
    data = pb_encode(as_format1(fields))
    with open(path, "wb") as f:
        f.write(data)
    return desc


def corrupt(kind, ckpt_dir, rng, steps):
    files = sorted(n for n in os.listdir(ckpt_dir)
                   if os.path.isfile(os.path.join(ckpt_dir, n)))
    shards = [n for n in files if n.startswith("shard_")]
    base = os.path.basename(ckpt_dir)
    if kind == "manifest":
        return base + ": " + edit_manifest(os.path.join(ckpt_dir, "manifest.pb"), rng, steps)
    pick = rng.choice(shards) if shards and rng.random() < 0.75 else "manifest.pb"
    path = os.path.join(ckpt_dir, pick)
    size = os.path.getsize(path)
    if kind == "truncate":
        new = rng.randrange(size) if size else 0
        os.truncate(path, new)
        return f"{base}/{pick} truncated from {size} to {new} bytes"
    # bitflip
    n = rng.randint(1, 4)
    with open(path, "r+b") as f:
        offs = sorted(rng.randrange(size) for _ in range(n))
        for off in offs:
            f.seek(off)
            b = f.read(1)[0]
            f.seek(off)
            f.write(bytes([b ^ (1 << rng.randrange(8))]))
    return f"{base}/{pick}: {n} bit(s) flipped at byte(s) {','.join(map(str, offs))}"


# --------------------------------------------------------------------------------------------
# One job


class Interrupted(Exception):
    """SIGINT, SIGTERM or --time-limit: the launch in flight is killed, the run FAILs."""


CURRENT = []  # the Popen in flight, killed (with its ranks) if the harness is interrupted
TIME_LIMIT = [None]  # monotonic deadline of the whole run (--time-limit)


def on_signal(signum, frame):
    raise Interrupted(f"interrupted by signal {signum}")


class Launch:
    """One start of the job's command, with at most one fault injected while it runs."""

    def __init__(self, number, fault, detail=""):
        self.number = number
        self.fault = fault  # None: run to the end
        self.detail = detail
        self.rc = None
        self.stdout = ""
        self.stderr = ""
        self.injected = False
        self.no_window = False  # a kill9_async that saw no save in flight and struck anyway
        self.lost_race = False  # the run ended before the kill reached it
        self.steps_trained = 0
        self.wall = 0.0
        self.t_first_step = None  # seconds after the start when the first step line appeared
        self.t_last_step = None
        self.steps_seen = 0  # step lines seen while it ran


class Job:
    def __init__(self, name, args, rng, root, faults):
        self.name = name
        self.args = args
        self.rng = rng
        self.ranks, extra, self.is_async = JOBS[name]
        self.sets = BASE_SETS + extra + [f"train.steps={args.steps}"]
        self.dir = os.path.join(root, name)
        self.ref_dir = os.path.join(self.dir, "reference")
        self.run_dir = os.path.join(self.dir, "run")
        self.ckdir = os.path.join(self.run_dir, "checkpoints")
        self.logs = os.path.join(self.dir, "logs")
        os.makedirs(self.logs)
        self.faults = faults
        self.launches = []
        self.failures = []
        self.corrupted = {}  # step -> (identity() of its directory, what was done)
        self.injected = {k: 0 for k in KINDS}
        self.missed = {k: 0 for k in KINDS}
        self.step_time = 0.05  # seconds per step, from the reference run
        self.startup = 1.0  # seconds from the start to the first step line, likewise
        self.ref_wall = 0.0
        self.done = False
        self.sigterm2_launches = 0

    # -- the command ------------------------------------------------------------------------
    def command(self, run_dir):
        cmd = [self.args.bin_train]
        for s in self.sets:
            cmd += ["--set", s]
        cmd += ["--run-dir", run_dir]
        if self.ranks > 1:
            cmd = [self.args.mpiexec, "-n", str(self.ranks), "--oversubscribe", "--bind-to",
                   "none"] + cmd
        return cmd

    def fail(self, launch, what, show_output=True):
        msg = f"[{self.name}] FAIL: "
        if launch is not None:
            fault = launch.fault or "none (run to the end)"
            detail = f", {launch.detail}" if launch.detail else ""
            msg += f"launch #{launch.number} (fault {fault}{detail}): "
        msg += what
        if launch is not None and show_output:
            msg += f"\n  exit code {launch.rc}; last lines of stderr:\n{tail(launch.stderr)}"
            msg += f"\n  last lines of stdout:\n{tail(launch.stdout, 6)}"
        self.failures.append(msg)
        print(msg, flush=True)

    def log(self, text):
        if self.args.verbose:
            print(f"[{self.name}] {text}", flush=True)

    # -- running one launch -----------------------------------------------------------------
    def rank_pids(self, p):
        if self.ranks == 1:
            return {0: p.pid}
        out = {}
        for c in descendants(p.pid):
            r = rank_of(c)
            if r is not None and c not in out.values():
                try:
                    with open(f"/proc/{c}/comm") as f:
                        if "keel-train" not in f.read():
                            continue
                except OSError:
                    continue
                out[r] = c
        return out

    def run(self, run_dir, launch, timeout, target_step=None):
        """Starts the command, injects launch.fault, waits (bounded). Fills launch.rc/stdout/
        stderr. Returns False when it hung."""
        cmd = self.command(run_dir)
        out_path = os.path.join(self.logs, f"launch_{launch.number:03d}.out")
        err_path = os.path.join(self.logs, f"launch_{launch.number:03d}.err")
        env = dict(os.environ)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
        t0 = now()
        with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
            p = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        CURRENT[:] = [p]
        fault = launch.fault
        rng = self.rng
        # The fault's plan.
        plan = {}
        if fault in ("kill9", "kill9_async", "sigterm", "sigterm2"):
            if fault == "kill9" and rng.random() < 0.2:
                # While it starts and resumes: at a random time, at the latest at the first step.
                plan["at_start"] = rng.uniform(0.0, 1.2 * self.startup)
                launch.detail = f"{plan['at_start']:.2f} s after the start"
            else:
                plan["step"] = target_step
                launch.detail = f"at step {target_step}"
            if fault == "kill9" and "step" in plan:
                plan["delay"] = rng.uniform(0.0, 1.5 * self.step_time)
            if fault == "kill9_async" or (fault in ("kill9", "sigterm", "sigterm2") and "step"
                                          in plan and rng.random() < 0.3):
                plan["during_save"] = True
                launch.detail += ", during a save"
            if fault == "sigterm2":
                # The repeat: as soon as the stop line is printed (the process is shutting down;
                # every job's first double SIGTERM), or at once, soon, later: all within the 5 s
                # in which keel-train ignores a repeat.
                gaps = ["after the stop line", 0.0, rng.uniform(0.0, 0.1), rng.uniform(0.1, 0.5),
                        rng.uniform(0.5, 2.0)]
                plan["gap"] = gaps[0] if self.sigterm2_launches == 0 else rng.choice(gaps)
                self.sigterm2_launches += 1
                plan["all_ranks"] = self.ranks > 1 and rng.random() < 0.5
                if plan["gap"] == "after the stop line":
                    launch.detail += ", second once the stop line is printed"
                else:
                    launch.detail += f", second {plan['gap']:.2f} s later"
                if plan["all_ranks"]:
                    launch.detail += ", to every rank"
            plan["rank"] = rng.randrange(self.ranks)
            if self.ranks > 1 and not plan.get("all_ranks"):
                launch.detail += f", rank {plan['rank']}"
        pos = 0
        buf = b""
        last_step = None
        first_step = None
        armed_at = None  # when the target step was seen
        second_at = None
        stop_line_seen = False
        deadline = t0 + timeout
        hung = False
        pids = {}
        ck = os.path.join(run_dir, "checkpoints")
        while True:
            if p.poll() is not None:
                break
            t = now()
            if t > deadline:
                hung = True
                kill_tree(p)
                p.wait()
                break
            if TIME_LIMIT[0] is not None and t > TIME_LIMIT[0]:
                kill_tree(p)
                p.wait()
                raise Interrupted(f"--time-limit reached during launch #{launch.number} of "
                                  f"{self.name}")
            # Progress from stdout (rank 0's "step N/T" lines, fresh for every launch).
            try:
                with open(out_path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                pos += len(chunk)
                buf += chunk
                cut = buf.rfind(b"\n")
                if cut >= 0:
                    stop_line_seen = stop_line_seen or b"stopped by SIG" in buf[:cut + 1]
                    for m in STEP_LINE.finditer(buf[:cut + 1]):
                        last_step = int(m.group(1))
                        if first_step is None:
                            first_step = last_step
                            launch.t_first_step = t - t0
                        launch.t_last_step = t - t0
                        launch.steps_seen += 1
                    buf = buf[cut + 1:]
            except OSError:
                pass
            if fault and not launch.injected:
                if len(pids) < self.ranks:
                    pids = self.rank_pids(p)
                fire = False
                if "at_start" in plan:
                    fire = t - t0 >= plan["at_start"] or last_step is not None
                elif last_step is not None and last_step >= plan["step"]:
                    if armed_at is None:
                        armed_at = (t, last_step)
                    if plan.get("during_save"):
                        try:
                            fire = any(n.endswith(".tmp") for n in os.listdir(ck))
                        except OSError:
                            fire = False
                        if fire:
                            launch.detail += f" (a step_*.tmp present, step {last_step})"
                        elif last_step >= armed_at[1] + EVERY + 2:
                            fire = True
                            launch.detail += " (no step_*.tmp seen: struck anyway)"
                            launch.no_window = True
                    else:
                        fire = t - armed_at[0] >= plan.get("delay", 0.0)
                if fire and len(pids) == self.ranks:
                    sig = signal.SIGKILL if fault.startswith("kill9") else signal.SIGTERM
                    targets = (list(pids.values()) if plan.get("all_ranks")
                               else [pids[plan["rank"]]])
                    for pid in targets:
                        try:
                            os.kill(pid, sig)
                        except OSError:
                            pass
                    launch.injected = True
                    if fault == "sigterm2":
                        second_at = (None if plan["gap"] == "after the stop line"
                                     else t + plan["gap"], targets)
            if second_at is not None and second_at[0] is None and stop_line_seen:
                second_at = (t, second_at[1])
            if second_at is not None and second_at[0] is not None and t >= second_at[0]:
                for pid in second_at[1]:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except OSError:
                        pass
                second_at = None
            armed = (plan.get("during_save") and armed_at is not None and not launch.injected) \
                or second_at is not None
            time.sleep(0.001 if armed else 0.005)
        CURRENT[:] = []
        launch.wall = now() - t0
        launch.rc = p.returncode
        # No rank may outlive mpiexec (it would share the run directory with the next launch).
        for pid in pids.values():
            t_end = now() + 10
            while alive(pid) and now() < t_end:
                time.sleep(0.05)
            if alive(pid):
                self.fail(launch, f"rank pid {pid} still alive 10 s after mpiexec exited; killed",
                          show_output=False)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        with open(out_path, errors="replace") as f:
            launch.stdout = f.read()
        with open(err_path, errors="replace") as f:
            launch.stderr = f.read()
        # Count the steps the launch printed (the loop may have missed the last chunk).
        launch.steps_trained = len(STEP_LINE.findall(launch.stdout.encode()))
        return not hung

    # -- the reference ----------------------------------------------------------------------
    def reference(self):
        launch = Launch(0, None)
        t0 = now()
        ok = self.run(self.ref_dir, launch, timeout=self.args.ref_timeout)
        self.ref_wall = now() - t0
        if not ok:
            self.fail(launch, f"the reference run hung (no exit within {self.args.ref_timeout} s)")
            return None
        if launch.rc != 0 or BAD_OUTPUT.search(launch.stdout + launch.stderr):
            self.fail(launch, "the reference run (no fault) did not end cleanly with exit 0")
            return None
        if launch.t_first_step is not None:
            self.startup = launch.t_first_step
            if launch.steps_seen > 1:
                self.step_time = max(0.001, (launch.t_last_step - launch.t_first_step)
                                     / (launch.steps_seen - 1))
        ref = read_metrics(os.path.join(self.ref_dir, "metrics.jsonl"))
        problems = metrics_problems(ref, self.args.steps)
        if problems:
            self.fail(None, "the reference run's metrics.jsonl: " + problems +
                      " (a spike-guard event in the reference? try another --steps)")
            return None
        self.log(f"reference: {self.args.steps} steps in {self.ref_wall:.1f} s (start "
                 f"{self.startup:.2f} s, {1000 * self.step_time:.1f} ms a step)")
        return ref

    # -- the chaos run ----------------------------------------------------------------------
    def newest_corruptible(self):
        """(step, path) of the newest committed checkpoint when it is intact and an older intact
        one exists to fall back to; else None."""
        c = committed(self.ckdir)
        intact = [s for s in c if not self.is_corrupt(s, c)]
        if not c:
            return None
        newest = max(c)
        if newest not in intact or not [s for s in intact if s < newest]:
            return None
        return newest, c[newest]

    def is_corrupt(self, step, c=None):
        c = committed(self.ckdir) if c is None else c
        if step not in self.corrupted or step not in c:
            return False
        return identity(c[step]) == self.corrupted[step][0]

    def forget_replaced(self):
        c = committed(self.ckdir)
        for s in list(self.corrupted):
            if not self.is_corrupt(s, c):
                del self.corrupted[s]

    def expected_resume(self):
        c = committed(self.ckdir)
        intact = [s for s in c if not self.is_corrupt(s, c)]
        return max(intact) if intact else 0

    def launch_timeout(self, remaining_steps):
        return self.args.launch_timeout + 20 * self.step_time * remaining_steps

    def chaos_launch(self, fault, target_step, disk_note):
        number = len(self.launches) + 1
        launch = Launch(number, fault)
        self.launches.append(launch)
        expect = self.expected_resume()
        corrupt_newest = [s for s in self.corrupted if self.is_corrupt(s)]
        timeout = self.launch_timeout(self.args.steps - expect)
        ok = self.run(self.run_dir, launch, timeout, target_step)
        if disk_note:
            launch.detail = (launch.detail + "; " if launch.detail else "") + "after " + disk_note
        out = launch.stdout + launch.stderr
        if (ok and launch.injected and fault.startswith("kill9") and launch.rc == 0
                and "keel-train: done:" in out):
            launch.lost_race = True  # the run ended before the kill reached it: no failure
            launch.injected = False
        if launch.injected:
            # A kill meant for an async save's window that saw none counts as a plain kill -9.
            kind = "kill9" if fault == "kill9_async" and launch.no_window else fault
            self.injected[kind] += 1
        elif fault:
            self.missed[fault] += 1
        detail = f" ({launch.detail})" if launch.detail else ""
        self.log(f"launch #{number}: fault {fault or 'none'}{detail} -> exit {launch.rc} in "
                 f"{launch.wall:.1f} s, {launch.steps_trained} steps"
                 + ("" if launch.injected or not fault else " [fault not injected: run ended]"))
        if not ok:
            self.fail(launch, f"hung: no exit within {timeout:.0f} s; killed")
            self.forget_replaced()
            return launch
        # Exit code.
        if launch.injected and fault.startswith("kill9"):
            expected = [-9] if self.ranks == 1 else [137]
        else:
            expected = [0]
        if launch.rc not in expected:
            self.fail(launch, f"exit code {launch.rc}, expected {' or '.join(map(str, expected))}")
        elif BAD_OUTPUT.search(out):
            self.fail(launch, "its output has an internal error or stack trace: "
                      + BAD_OUTPUT.search(out).group(0))
        # Resume.
        m = RESUME_LINE.search(out)
        unusable = UNUSABLE_LINE.findall(out)
        for path, why in unusable:
            ms = re.search(r"step_(\d{8})", path)
            s = int(ms.group(1)) if ms else None
            if s not in corrupt_newest:
                self.fail(launch, f"{path} was called unusable ({why}) but the harness did not "
                          "corrupt it (a fault left a committed checkpoint damaged?)")
        if m:
            got = int(m.group(2))
            if got != expect:
                self.fail(launch, f"resumed at step {got}, expected step {expect} (the newest "
                          f"intact checkpoint; corrupted by the harness: "
                          f"{sorted(corrupt_newest) or 'none'})")
            for s in corrupt_newest:
                if s > got and not any(f"step_{s:08d}" in pth for pth, _ in unusable):
                    self.fail(launch, f"passed over the corrupted step_{s:08d} without saying "
                              "why it is unusable")
        elif expect > 0 and launch.steps_trained > 0 and re.search(r"^step\s+1/", launch.stdout,
                                                                   re.M):
            self.fail(launch, f"started from step 1 although checkpoint step {expect} exists")
        # A graceful stop saved its step, and LATEST names it.
        if fault in ("sigterm", "sigterm2") and launch.injected and launch.rc == 0:
            st = STOPPED_LINE.search(out)
            if st:
                s = int(st.group(1))
                try:
                    with open(os.path.join(self.ckdir, "LATEST")) as f:
                        latest = f.read().strip()
                except OSError:
                    latest = "(missing)"
                if latest != f"step_{s:08d}" or not os.path.isdir(
                        os.path.join(self.ckdir, f"step_{s:08d}")):
                    self.fail(launch, f"stopped after step {s} but LATEST says {latest!r}")
            elif "keel-train: done:" not in out:
                self.fail(launch, "exit 0 after SIGTERM without a 'stopped by SIGTERM' line")
        if launch.rc == 0 and "keel-train: done:" in out:
            self.done = True
        self.forget_replaced()
        return launch

    def apply_disk_fault(self, kind):
        target = self.newest_corruptible()
        if target is None:
            return None
        step, path = target
        try:
            desc = corrupt(kind, path, self.rng, sorted(committed(self.ckdir)))
        except (OSError, ValueError, IndexError, StopIteration) as e:
            desc = f"{os.path.basename(path)}: {kind} failed ({e})"
            self.fail(None, "could not apply the fault: " + desc)
        self.corrupted[step] = (identity(path), desc)
        self.injected[kind] += 1
        self.done = False  # the run must be finished again from the previous checkpoint
        return f"{kind}: {desc}"

    def chaos(self):
        faults = list(self.faults)
        launch_faults = [f for f in faults if f in LAUNCH_KINDS]
        n_steps = self.args.steps
        # Where each launch fault strikes: spread over the run, in order.
        targets = sorted(self.rng.randint(1, max(1, n_steps - 1)) for _ in launch_faults)
        pending = []
        ti = 0
        for fault in faults:
            if fault in DISK_KINDS:
                pending.append(fault)
                continue
            note = ""
            if pending:
                applied = self.apply_disk_fault(pending[0])
                if applied:
                    pending.pop(0)
                    note = applied
            resume = self.expected_resume()
            target = min(max(targets[ti], resume + 1), n_steps - 1)
            ti += 1
            if resume >= n_steps - 1 and not note:
                # No step left to strike in (an earlier fault missed and the run ended).
                self.missed[fault] += 1
                self.log(f"fault {fault} skipped: the run is at step {resume} of {n_steps}")
                continue
            self.chaos_launch(fault, max(target, resume + 1), note)
            if len(self.failures) > self.args.max_failures:
                return
        # Finish: the same command until it exits 0; leftover corruptions on the way.
        attempts = 0
        while attempts < 4 + len(pending):
            note = ""
            if pending:
                applied = self.apply_disk_fault(pending[0])
                if applied:
                    pending.pop(0)
                    note = applied
            if self.done and not note:
                break
            attempts += 1
            self.chaos_launch(None, None, note)
        for k in pending:
            self.missed[k] += 1
        if not self.done:
            self.fail(None, f"the run did not finish with exit 0 in {attempts} final launches")

    # -- final checks -----------------------------------------------------------------------
    def final_checks(self, ref):
        got = read_metrics(os.path.join(self.run_dir, "metrics.jsonl"))
        problems = metrics_problems(got, self.args.steps)
        if problems:
            self.fail(None, "metrics.jsonl: " + problems)
        ref_by = {r["step"]: r for r in ref}
        diffs = []
        for r in got:
            want = ref_by.get(r["step"])
            if want is None:
                continue
            for k in sorted(set(want) | set(r)):
                if k == "tokens_per_s":
                    continue
                if want.get(k) != r.get(k):
                    diffs.append((int(r["step"]), k, want.get(k), r.get(k)))
        if diffs:
            s, k, w, g = min(diffs)
            n_steps = len({d[0] for d in diffs})
            self.fail(None, f"metrics differ from the uninterrupted run at {n_steps} step(s); "
                      f"the first: step {s} {k} = {g}, reference {w}")
        # The final checkpoint.
        v = subprocess.run([self.args.bin_ckpt, "verify", self.run_dir], capture_output=True,
                           text=True, timeout=120)
        if v.returncode != 0:
            self.fail(None, f"keel-ckpt verify {self.run_dir}: exit {v.returncode}: "
                      f"{(v.stdout + v.stderr).strip()[-2000:]}")
        final = os.path.join(self.ckdir, f"step_{self.args.steps:08d}")
        ref_final = os.path.join(self.ref_dir, "checkpoints", f"step_{self.args.steps:08d}")
        try:
            with open(os.path.join(self.ckdir, "LATEST")) as f:
                latest = f.read().strip()
        except OSError:
            latest = "(missing)"
        if latest != os.path.basename(final):
            self.fail(None, f"LATEST names {latest!r}, not the final {os.path.basename(final)}")
        if os.path.isdir(final) and os.path.isdir(ref_final):
            for n in sorted(os.listdir(ref_final)):
                if not n.startswith("shard_"):
                    continue
                a, b = os.path.join(ref_final, n), os.path.join(final, n)
                if not os.path.exists(b) or not same_bytes(a, b):
                    self.fail(None, f"{b} differs from the uninterrupted run's {a}")
                    break
        else:
            self.fail(None, f"{final} (or the reference's) is missing")
        names = os.listdir(self.ckdir) if os.path.isdir(self.ckdir) else []
        left = [n for n in names if n.endswith(".tmp") or n.endswith(".old")]
        if left:
            self.fail(None, f"left behind in {self.ckdir}: {', '.join(sorted(left))}")
        kept = sorted(committed(self.ckdir))
        bound = KEEP + REWIND_MARGIN // EVERY + 1
        if len(kept) > bound:
            self.fail(None, f"retention kept {len(kept)} checkpoints ({kept}), more than "
                      f"checkpoint.keep={KEEP} + the spike guard's rewind pins ({bound})")
        try:
            with open(os.path.join(self.run_dir, "alerts.jsonl")) as f:
                kinds = [json.loads(l).get("kind") for l in f if l.strip()]
        except (OSError, ValueError) as e:
            kinds = [f"unreadable: {e}"]
        bad = [k for k in kinds if k in ("spike", "nan", "rewind", "skip", "halt")
               or str(k).startswith("unreadable")]
        if bad:
            self.fail(None, f"alerts.jsonl has spike-guard events {bad}: resume was not bitwise")

    def sequence(self):
        lines = ["    command: " + " ".join(self.command(self.run_dir)),
                 f"    logs: {self.logs}/launch_NNN.{{out,err}} (000: the reference run)"]
        for l in self.launches:
            lines.append(f"    #{l.number}: {l.fault or 'none'}"
                         f"{' (' + l.detail + ')' if l.detail else ''} -> exit {l.rc}"
                         f"{'' if l.injected or not l.fault else ' [not injected]'}")
        return "\n".join(lines)


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def read_metrics(path):
    """Every line of metrics.jsonl, numbers kept as the exact strings written."""
    out = []
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line, parse_float=str, parse_int=str)
                except ValueError:
                    rec = {"step": f"unparsable line {i}: {line[:80]!r}"}
                out.append(rec)
    except OSError:
        pass
    return out


def metrics_problems(recs, n_steps):
    steps = []
    for r in recs:
        try:
            steps.append(int(r.get("step")))
        except (TypeError, ValueError):
            return f"bad line: {r.get('step')}"
    for r in recs:
        r["step"] = int(r["step"])
    if steps == list(range(1, n_steps + 1)):
        return ""
    seen, dup, disorder = set(), [], []
    for i, s in enumerate(steps):
        if s in seen:
            dup.append(s)
        seen.add(s)
        if i and s <= steps[i - 1]:
            disorder.append((steps[i - 1], s))
    missing = sorted(set(range(1, n_steps + 1)) - seen)
    parts = [f"{len(steps)} lines for {n_steps} steps"]
    if dup:
        parts.append(f"steps logged twice: {dup[:10]}")
    if disorder:
        parts.append(f"out of order: {disorder[:5]}")
    if missing:
        parts.append(f"missing steps: {missing[:10]}{'...' if len(missing) > 10 else ''}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# The plan


def plan_faults(rng, n, jobs, allowed):
    """n fault kinds of `allowed`, each at least once when n allows it, spread over the jobs
    (kill9_async only on async jobs; every multi-rank job gets a kill -9 and a SIGTERM first)."""
    async_jobs = [j for j in jobs if JOBS[j][2]]
    multi = [j for j in jobs if JOBS[j][0] > 1]
    kinds = [k for k in allowed if k != "kill9_async" or async_jobs]
    required = []  # (kind, job or None)
    for j in multi:
        required += [(k, j) for k in ("kill9", "sigterm") if k in kinds]
    for k in kinds:
        if not any(rk == k for rk, _ in required):
            required.append((k, None))
    weights = {"kill9": 4, "kill9_async": 2, "sigterm": 2, "sigterm2": 2, "truncate": 1,
               "bitflip": 1, "manifest": 1}
    if not kinds:
        return {j: [] for j in jobs}
    chosen = required[:n]
    while len(chosen) < n:
        chosen.append((rng.choices(kinds, [weights[k] for k in kinds])[0], None))
    per_job = {j: [] for j in jobs}
    for k, j in chosen:
        if j is None:
            eligible = async_jobs if k == "kill9_async" else jobs
            least = min(len(per_job[x]) for x in eligible)
            j = rng.choice([x for x in eligible if len(per_job[x]) == least])
        per_job[j].append(k)
    for j in jobs:
        rng.shuffle(per_job[j])
        # Every disk fault needs a later launch fault or the finish to be noticed; none needed.
    return per_job


def find_binary(name, given):
    if given:
        return given
    here = os.path.dirname(os.path.abspath(__file__))
    cand = os.path.join(here, "..", "..", "build", "launch", name)
    return os.path.normpath(cand)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the header of this file for what is checked.")
    ap.add_argument("--keel-train", help="keel-train binary (default: build/launch/keel-train)")
    ap.add_argument("--keel-ckpt", help="keel-ckpt binary (default: build/launch/keel-ckpt)")
    ap.add_argument("--mpiexec", default=shutil.which("mpiexec") or "/usr/bin/mpiexec")
    ap.add_argument("--seed", type=int, help="the RNG seed (default: random, printed)")
    ap.add_argument("--faults", type=int, default=16, help="faults in all (default 16)")
    ap.add_argument("--steps", type=int, default=40, help="train.steps of every job (default 40)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated fault kinds to draw from (default all: "
                         f"{','.join(KINDS)})")
    ap.add_argument("--jobs", default=",".join(JOBS),
                    help=f"comma-separated layouts (default all: {','.join(JOBS)})")
    ap.add_argument("--launch-timeout", type=float, default=90.0,
                    help="seconds a launch may take on top of 20x the reference's time for "
                         "the steps it has left (default 90)")
    ap.add_argument("--ref-timeout", type=float, default=None,
                    help="seconds for a reference run (default 120 + steps / 2)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run; past it the launch in flight is killed "
                         "and the run FAILs (set it below ctest's TIMEOUT so nothing is left "
                         "running)")
    ap.add_argument("--max-failures", type=int, default=10,
                    help="stop a job's fault loop after this many failures (default 10)")
    ap.add_argument("--work-dir", help="where the run directories go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after a PASS")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per launch")
    args = ap.parse_args()
    t_start = now()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 1 << 31)
    if args.ref_timeout is None:
        args.ref_timeout = 120 + args.steps / 2
    jobs = [j for j in args.jobs.split(",") if j]
    for j in jobs:
        if j not in JOBS:
            ap.error(f"--jobs: unknown job {j!r} (known: {', '.join(JOBS)})")
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            ap.error(f"--kinds: unknown fault kind {k!r} (known: {', '.join(KINDS)})")
    if args.steps < 2 * EVERY + 1:
        ap.error(f"--steps must be at least {2 * EVERY + 1}")
    if args.faults < 0:
        ap.error("--faults must be >= 0")
    train = find_binary("keel-train", args.keel_train)
    ckpt = find_binary("keel-ckpt", args.keel_ckpt)
    for b in (train, ckpt):
        if not os.access(b, os.X_OK):
            ap.error(f"{b}: not an executable (build it: /work/kb keel-train keel-ckpt, or pass "
                     "--keel-train/--keel-ckpt)")
    if any(JOBS[j][0] > 1 for j in jobs) and not os.access(args.mpiexec, os.X_OK):
        ap.error(f"--mpiexec {args.mpiexec}: not an executable")
    print(f"chaos: seed {args.seed} (reproduce with --seed {args.seed} --faults {args.faults} "
          f"--steps {args.steps} --jobs {','.join(jobs)}"
          + ("" if kinds == KINDS else f" --kinds {','.join(kinds)}") + ")", flush=True)

    if args.work_dir:
        root = os.path.abspath(args.work_dir)
        if os.path.isdir(root) and os.listdir(root):
            if not os.path.exists(os.path.join(root, ".keel-chaos")):
                ap.error(f"--work-dir {root} is not empty and not an earlier chaos work dir")
            shutil.rmtree(root)
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="keel-chaos-")
    open(os.path.join(root, ".keel-chaos"), "w").close()
    # Snapshots of the binaries: a rebuild during the run must not change them.
    os.makedirs(os.path.join(root, "bin"))
    args.bin_train = os.path.join(root, "bin", "keel-train")
    args.bin_ckpt = os.path.join(root, "bin", "keel-ckpt")
    shutil.copy2(train, args.bin_train)
    shutil.copy2(ckpt, args.bin_ckpt)

    rng = random.Random(args.seed)
    per_job = plan_faults(rng, args.faults, jobs, kinds)
    all_jobs = []
    interrupted = ""
    if args.time_limit:
        TIME_LIMIT[0] = t_start + args.time_limit
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for name in jobs:
            job = Job(name, args, random.Random(rng.randrange(1 << 62)), root, per_job[name])
            all_jobs.append(job)
            job.log(f"faults planned: {' '.join(job.faults) or 'none'}")
            ref = job.reference()
            if ref is None:
                continue
            job.chaos()
            job.final_checks(ref)
            if job.failures:
                print(f"[{name}] fault sequence (seed {args.seed}):\n{job.sequence()}",
                      flush=True)
    except Interrupted as e:
        interrupted = str(e)
        for p in CURRENT:
            kill_tree(p)
            p.wait()
        print(f"chaos: FAIL: {interrupted}", flush=True)
        for job in all_jobs[-1:]:
            print(f"[{job.name}] fault sequence (seed {args.seed}):\n{job.sequence()}",
                  flush=True)
    failures = sum(len(j.failures) for j in all_jobs) + (1 if interrupted else 0)
    injected = {k: sum(j.injected[k] for j in all_jobs) for k in KINDS}
    missed = {k: sum(j.missed[k] for j in all_jobs) for k in KINDS}
    restarts = sum(len(j.launches) for j in all_jobs)
    trained = sum(l.steps_trained for j in all_jobs for l in j.launches)
    wall = now() - t_start
    verdict = "PASS" if failures == 0 else "FAIL"
    n_missed = sum(missed.values())
    summary = (f"chaos: {verdict} seed={args.seed} jobs={','.join(jobs)} "
               f"faults={sum(injected.values())} ("
               + " ".join(f"{k}={injected[k]}" for k in KINDS)
               + (f"; not injected: {n_missed}" if n_missed else "")
               + f") restarts={restarts} steps={args.steps}x{len(jobs)} trained={trained} "
               f"wall={wall:.0f}s failures={failures}")
    if failures or args.keep:
        summary += f" work_dir={root}"
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(summary, flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
