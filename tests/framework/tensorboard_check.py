"""Reads keel's TensorBoard event files with the real tensorboard package (tensorboard_test.cc).

  tensorboard_check.py check LOGDIR EXPECTED   read LOGDIR three ways and compare with EXPECTED
  tensorboard_check.py write OUTDIR            write an event file with tensorboard's own writer

EXPECTED has one line per value keel wrote, tab-separated:
  scalar TAG STEP FLOAT32_BITS_HEX WALL_TIME
  text   TAG STEP UTF8_HEX         WALL_TIME
"check" reads LOGDIR through
  1. EventAccumulator, the Python loader behind `tensorboard --load_fast=false`;
  2. the record reader under it (tensorboard.compat.tensorflow_stub), which checks both masked
     CRC32Cs of every record; a copy with one flipped byte must fail its header or data check;
  3. the Rust data server behind `tensorboard --logdir` (load_fast), through its gRPC provider.
Every value must match bit for bit (NaN: NaN). Prints one line per finding; exits 1 on the first
mismatch, 0 when everything matched.
"""

import glob
import math
import os
import shutil
import struct
import sys
import tempfile
import time

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.plugins.text import text_plugin
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util


def fail(message):
    print("MISMATCH: " + message)
    sys.exit(1)


def read_expected(path):
    scalars, texts = {}, {}
    with open(path) as f:
        for line in f:
            kind, tag, step, payload, wall_time = line.rstrip("\n").split("\t")
            if kind == "scalar":
                value = struct.unpack("<f", bytes.fromhex(payload))[0]
                scalars.setdefault(tag, []).append((int(step), value, float(wall_time)))
            elif kind == "text":
                text = bytes.fromhex(payload).decode("utf-8")
                texts.setdefault(tag, []).append((int(step), text, float(wall_time)))
            else:
                fail("bad line in %s: %r" % (path, line))
    return scalars, texts


def same_float32(got, want):
    if math.isnan(want):
        return math.isnan(got)
    return struct.pack("<f", got) == struct.pack("<f", want)


def compare_scalars(source, tag, points, want):
    """points: (step, value, wall_time) read by tensorboard; want: the same, expected."""
    if [p[0] for p in points] != [w[0] for w in want]:
        fail("%s: %s steps %s, expected %s" % (source, tag, [p[0] for p in points],
                                               [w[0] for w in want]))
    for (step, value, wall_time), (_, want_value, want_wall) in zip(points, want):
        if not same_float32(value, want_value):
            fail("%s: %s step %d value %r, expected %r" % (source, tag, step, value, want_value))
        if wall_time != want_wall:
            fail("%s: %s step %d wall_time %r, expected %r" % (source, tag, step, wall_time,
                                                              want_wall))
    print("%s: scalar %s: %d points, steps %d..%d, values match" %
          (source, tag, len(points), points[0][0], points[-1][0]))


def as_text(array):
    value = array.item()
    return value.decode("utf-8") if isinstance(value, bytes) else value


def check_event_accumulator(logdir, scalars, texts):
    ea = event_accumulator.EventAccumulator(
        logdir, size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.TENSORS: 0
        })
    ea.Reload()
    if ea.file_version != 2.0:
        fail("event_accumulator: file_version %r, expected 2.0" % ea.file_version)
    tags = ea.Tags()
    if sorted(tags["scalars"]) != sorted(scalars):
        fail("event_accumulator: scalar tags %s, expected %s" % (sorted(tags["scalars"]),
                                                                 sorted(scalars)))
    print("event_accumulator: file_version 2, scalar tags " + " ".join(sorted(scalars)))
    for tag, want in sorted(scalars.items()):
        points = [(e.step, e.value, e.wall_time) for e in ea.Scalars(tag)]
        compare_scalars("event_accumulator", tag, points, want)
    text_tags = ea.PluginTagToContent("text")
    if sorted(text_tags) != sorted(texts):
        fail("event_accumulator: text plugin tags %s, expected %s" % (sorted(text_tags),
                                                                      sorted(texts)))
    for tag, want in sorted(texts.items()):
        events = ea.Tensors(tag)
        got = [(e.step, as_text(tensor_util.make_ndarray(e.tensor_proto)), e.wall_time)
               for e in events]
        if got != want:
            fail("event_accumulator: text %s: %r, expected %r" % (tag, got, want))
        for e in events:
            html = text_plugin.text_array_to_html(tensor_util.make_ndarray(e.tensor_proto),
                                                  enable_markdown=True)
            print("event_accumulator: text %s step %d html: %s" %
                  (tag, e.step, " ".join(html.split())))


def records(path):
    """(offset, length) of each record, from the framing alone."""
    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos < len(data):
        length = struct.unpack("<Q", data[pos:pos + 8])[0]
        out.append((pos, length))
        pos += 12 + length + 4
    return data, out


def read_all_records(path):
    reader = pywrap_tensorflow.PyRecordReader_New(path, 0, None, None)
    events = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return events
        events.append(event_pb2.Event.FromString(reader.record()))


def check_record_reader(path, n_values):
    events = read_all_records(path)
    if len(events) != 1 + n_values:
        fail("record reader: %d records, expected %d" % (len(events), 1 + n_values))
    if events[0].file_version != "brain.Event:2":
        fail("record reader: first record %r" % events[0])
    print("record reader: %d records, both CRCs of each verified" % len(events))

    data, spans = records(path)
    offset, length = spans[len(spans) // 2]
    scratch = tempfile.mkdtemp()
    try:
        for what, at, expect in [("length", offset + 3, "failed header crc32 check"),
                                 ("data", offset + 12 + length // 2, "failed event crc32 check")]:
            corrupt = bytearray(data)
            corrupt[at] ^= 0x01
            copy = os.path.join(scratch, "events.out.tfevents.corrupt")
            with open(copy, "wb") as f:
                f.write(corrupt)
            try:
                read_all_records(copy)
            except errors.DataLossError as e:
                if expect not in str(e):
                    fail("record reader: flipped %s byte gave %r, expected %r" % (what, str(e),
                                                                                  expect))
                print("record reader: flipped %s byte: %s" % (what, expect))
                continue
            fail("record reader: flipped %s byte at %d went undetected" % (what, at))
    finally:
        shutil.rmtree(scratch)


def check_data_server(logdir, scalars, texts):
    from tensorboard import context
    from tensorboard.data import server_ingester
    from tensorboard.util import grpc_util

    ingester = server_ingester.SubprocessServerDataIngester(
        server_ingester.get_server_binary(), logdir, reload_interval=0,
        channel_creds_type=grpc_util.ChannelCredsType.LOCAL,
        samples_per_plugin={"scalars": 0, "text": 0})
    ingester.start()
    provider = ingester.data_provider
    ctx = context.RequestContext()
    n_scalars = sum(len(v) for v in scalars.values())
    deadline = time.time() + 60
    while True:  # the server loads the logdir in the background after it starts
        got = provider.read_scalars(ctx, experiment_id="", plugin_name="scalars",
                                    downsample=100000)
        loaded = sum(len(series) for run in got.values() for series in run.values())
        if loaded >= n_scalars or time.time() > deadline:
            break
        time.sleep(0.2)
    if list(got) != ["."]:
        fail("data server: runs %s, expected the logdir itself ('.')" % list(got))
    run = got["."]
    if sorted(run) != sorted(scalars):
        fail("data server: scalar tags %s, expected %s" % (sorted(run), sorted(scalars)))
    for tag, want in sorted(scalars.items()):
        points = [(d.step, d.value, d.wall_time) for d in run[tag]]
        compare_scalars("data server", tag, points, want)
    tensors = provider.read_tensors(ctx, experiment_id="", plugin_name="text",
                                    downsample=100000).get(".", {})
    if sorted(tensors) != sorted(texts):
        fail("data server: text tags %s, expected %s" % (sorted(tensors), sorted(texts)))
    for tag, want in sorted(texts.items()):
        got = [(d.step, as_text(d.numpy), d.wall_time) for d in tensors[tag]]
        if got != want:
            fail("data server: text %s: %r, expected %r" % (tag, got, want))
        print("data server: text %s: %d summaries match" % (tag, len(got)))


def write_with_tensorboard(outdir):
    """A file from tensorboard's own writer, for keel's reader: a scalar series with a NaN and a
    text summary."""
    writer = EventFileWriter(outdir)
    for step, value in [(1, 1.5), (2, float("nan")), (3, 0.25)]:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="py/loss", simple_value=value)])
        writer.add_event(event_pb2.Event(wall_time=1000.0 + step, step=step, summary=summary))
    summary = text_summary.text_pb("py/text", "h\u00e9llo **markdown**")
    writer.add_event(event_pb2.Event(wall_time=1004.0, step=4, summary=summary))
    writer.close()
    print("wrote " + " ".join(sorted(glob.glob(os.path.join(outdir, "*tfevents*")))))


def main(argv):
    if len(argv) == 3 and argv[1] == "write":
        write_with_tensorboard(argv[2])
        return 0
    if len(argv) != 4 or argv[1] != "check":
        print(__doc__)
        return 2
    logdir, expected = argv[2], argv[3]
    scalars, texts = read_expected(expected)
    files = glob.glob(os.path.join(logdir, "*tfevents*"))
    if len(files) != 1:
        fail("expected one event file in %s, found %s" % (logdir, files))
    check_event_accumulator(logdir, scalars, texts)
    n_values = sum(len(v) for v in scalars.values()) + sum(len(v) for v in texts.values())
    check_record_reader(files[0], n_values)
    check_data_server(logdir, scalars, texts)
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
