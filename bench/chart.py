#!/usr/bin/env python3
"""Render a results JSON written by bench/gpu.py or bench/run.py as a PNG bar chart.

    python bench/chart.py bench-results/gpu.json bench-results/gpu.png
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import chart  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="JSON with 'system' and 'results' (gpu.json, suite.json)")
    parser.add_argument("png", help="chart to write")
    parser.add_argument("--skip", default="cold", help="leave out rows whose name contains this (default: cold)")
    args = parser.parse_args()
    with open(args.results) as f:
        data = json.load(f)
    system = data["system"].get("system", data["system"])
    rows = [r for r in data["results"] if not (args.skip and args.skip in r["name"])]
    title = (f"{system.get('gpu', '?')}, {system.get('io mode', '').split(':')[0]} mode, warm cache, "
             f"commit {system.get('commit', '?')}, {system.get('date', '')}")
    chart(rows, args.png, title)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
