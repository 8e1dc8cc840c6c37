#!/usr/bin/env python3
"""Every test's wall time from ctest's JUnit report (ctest --output-junit), slowest first.

  tests/test_times.py build/test-times.xml build/test-times.txt [N]

writes one line per test ("seconds status name") to the second file and prints the N slowest
(default 15) and the total, so that what makes a run slow is in sight after every tests/run.
"""
import sys
import xml.etree.ElementTree as ET


def main():
    report, out_path = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    rows = sorted(((float(c.get("time", 0)), c.get("status", "?"), c.get("name", "?"))
                   for c in ET.parse(report).getroot().iter("testcase")),
                  key=lambda r: -r[0])
    with open(out_path, "w") as out:
        out.write("# seconds status test, slowest first (tests/run, from ctest's JUnit report)\n")
        for seconds, status, name in rows:
            out.write(f"{seconds:9.2f} {status:9} {name}\n")
    total = sum(r[0] for r in rows)
    print(f"keel: {len(rows)} tests, {total:.0f} s in all; the {min(top, len(rows))} slowest "
          f"(every test in {out_path}):")
    for seconds, status, name in rows[:top]:
        print(f"  {seconds:7.1f} s  {name}" + ("" if status == "run" else f"  ({status})"))


if __name__ == "__main__":
    main()
