#!/usr/bin/env python3
"""Plots a `kvr replay --json` report: one panel per metric, one bar per policy.

Usage: plot_replay.py REPORT.json OUTPUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main(report_path: str, output_path: str) -> int:
    with open(report_path, encoding="utf-8") as handle:
        report = json.load(handle)
    policies = [entry["policy"] for entry in report["policies"]]
    if not policies:
        print("plot_replay: the report holds no policies", file=sys.stderr)
        return 1
    panels = [
        ("KV hit rate", [e["hit_rate"] for e in report["policies"]], report["infinite_cache_hit_rate"]),
        ("TTFT mean (ms)", [e["ttft_ms"]["mean"] for e in report["policies"]], None),
        ("TTFT p99 (ms)", [e["ttft_ms"]["p99"] for e in report["policies"]], None),
        ("Inter-token latency mean (ms)", [e["itl_ms"]["mean"] for e in report["policies"]], None),
        ("End-to-end p50 (ms)", [e["e2e_ms"]["p50"] for e in report["policies"]], None),
        ("Load imbalance (max/mean)", [e["load_imbalance"] for e in report["policies"]], 1.0),
    ]
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (title, values, reference) in zip(axes.flat, panels):
        axis.bar(policies, values, color=[colors[i % len(colors)] for i in range(len(policies))])
        axis.set_title(title)
        axis.tick_params(axis="x", labelrotation=30)
        if reference is not None:
            axis.axhline(reference, color="black", linestyle="--", linewidth=1)
        for index, value in enumerate(values):
            axis.annotate(f"{value:.3g}", (index, value), ha="center", va="bottom", fontsize=8)
    figure.suptitle(
        f"kvr replay: {report['trace']} — {report['requests']} requests, {report['workers']} workers, "
        f"speedup {report['speedup']:g}"
        + " (dashed: infinite-cache hit rate / perfect balance)"
    )
    figure.tight_layout()
    figure.savefig(output_path, dpi=110)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
