#!/usr/bin/env python3
"""Writes deploy/data/agent_sessions_trace.jsonl: a synthetic agent workload in the Mooncake trace
format (timestamp ms, input_length, output_length, 512-token prefix-chained hash_ids), shaped
unlike the bundled conversation trace: many distinct long system prompts (one per agent app,
4k-12k tokens, app popularity Zipf-like) and sessions whose turns grow, each turn appending the
previous answer and a tool result to the context. Deterministic: the same seed writes the same
bytes. Standard library only.

Usage: deploy/scripts/make_agent_trace.py [--seed N] [--sessions N] [--out PATH]
"""
import argparse
import json
import random

BLOCK = 512


class PrefixIds:
    """Gives each distinct prompt prefix, block by block, the next unused integer id."""

    def __init__(self):
        self.ids = {}

    def hash_ids(self, segments):
        # segments: [(segment_id, tokens)]; a block's content is the segment slices it covers.
        ids, parent = [], -1
        total = sum(length for _, length in segments)
        position, index, offset = 0, 0, 0
        while position < total:
            end = min(position + BLOCK, total)
            signature = []
            while position < end:
                segment, length = segments[index]
                take = min(length - offset, end - position)
                signature.append((segment, offset, take))
                position += take
                offset += take
                if offset == length:
                    index, offset = index + 1, 0
            key = (parent, tuple(signature))
            if key not in self.ids:
                self.ids[key] = len(self.ids)
            parent = self.ids[key]
            ids.append(parent)
        return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sessions", type=int, default=1600)
    parser.add_argument("--apps", type=int, default=48)
    parser.add_argument("--duration-s", type=float, default=3600)
    parser.add_argument("--out", default="deploy/data/agent_sessions_trace.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    app_prompts = [rng.randint(4000, 12000) for _ in range(args.apps)]
    app_weights = [1.0 / (rank + 1) ** 0.8 for rank in range(args.apps)]
    next_segment = [args.apps]  # segment ids 0..apps-1 are the system prompts

    def new_segment():
        next_segment[0] += 1
        return next_segment[0]

    requests = []
    for _ in range(args.sessions):
        app = rng.choices(range(args.apps), weights=app_weights)[0]
        start_ms = rng.uniform(0, args.duration_s * 1000 * 0.92)
        context = [(app, app_prompts[app]), (new_segment(), rng.randint(100, 1500))]
        turns = rng.randint(3, 12)
        at_ms = start_ms
        for turn in range(turns):
            output = rng.randint(30, 400) if turn < turns - 1 else rng.randint(200, 900)
            input_length = sum(length for _, length in context)
            requests.append((int(at_ms), input_length, output, list(context)))
            # The agent reads the answer, calls a tool, and sends the next turn with both appended.
            context = context + [(new_segment(), output), (new_segment(), rng.randint(300, 4000))]
            at_ms += rng.uniform(3000, 15000)

    ids = PrefixIds()
    requests.sort(key=lambda request: request[0])
    with open(args.out, "w") as out:
        for timestamp, input_length, output, context in requests:
            record = {"timestamp": timestamp, "input_length": input_length,
                      "output_length": output, "hash_ids": ids.hash_ids(context)}
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
