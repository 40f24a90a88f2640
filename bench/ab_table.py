"""Prints the results files of bench/ab.sh (``<build>-<pass>.json``, and the demo logs
``<build>-demo<pass>.log``) as one table: a row per shape and result key, a column per build, the
passes' medians separated by slashes."""
import collections
import json
import os
import re
import sys


def demo_rows(path):
    """A demo log's problems (``== <arguments>`` lines) and their RESULT times, as results rows."""
    rows, shape = [], None
    for line in open(path):
        if line.startswith("== "):
            shape = line[3:].strip()
        m = re.search(r"RESULT .*us=([0-9.]+)", line)
        if m and shape:
            rows.append({"id": "demo " + shape, "results": {"kvstream": {"us": float(m.group(1))}}})
    return rows


def main(paths):
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    builds = []
    for path in sorted(paths):
        build = os.path.basename(path).rsplit("-", 1)[0]
        if build not in builds:
            builds.append(build)
        rows = demo_rows(path) if path.endswith(".log") else json.load(open(path))["rows"]
        for row in rows:
            for key, res in row["results"].items():
                times[(row["id"], key)][build].append(res["us"])
    print(f"{'shape / key (us)':40s}" + "".join(f"{b:>18s}" for b in builds))
    for (shape, key), by_build in sorted(times.items()):
        cells = ("/".join(f"{t:.2f}" for t in by_build.get(b, [])) for b in builds)
        print(f"{shape + ' ' + key:40s}" + "".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main(sys.argv[1:])
