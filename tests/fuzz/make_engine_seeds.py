#!/usr/bin/python3
"""Writes the msgpack seeds of tests/fuzz/corpus/engine_kv_events/: the KV event batches of the
bridge's golden tests (tests/unit/deploy/bridge/make_golden_payloads.py, every layout vLLM and
SGLang have shipped) and a few payloads the decoder must refuse, packed by Python's msgpack module
(Debian python3-msgpack).

Run from the repository root: /usr/bin/python3 tests/fuzz/make_engine_seeds.py
"""
import pathlib
import sys

import msgpack

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "deploy" / "bridge"))
from make_golden_payloads import CASES, TOKENS  # noqa: E402



def nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


REFUSED = {
    # Nesting beyond the decoder's depth bound (16).
    "refused_too_deep": [0.0, nested(20)],
    # A token id beyond uint32.
    "refused_token_range": [0.0, [["BlockStored", [1], None, [2**40], 4, None, "GPU"]]],
    # A block size of zero.
    "refused_block_size": {"ts": 0.0, "events": [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": TOKENS[:4], "block_size": 0}]},
}


def main():
    out = ROOT / "tests" / "fuzz" / "corpus" / "engine_kv_events"
    out.mkdir(parents=True, exist_ok=True)
    for name, value in {**CASES, **REFUSED}.items():
        (out / f"{name}.msgpack").write_bytes(msgpack.packb(value, use_bin_type=True))
    # A container that declares more elements than the payload holds (array32 of 2^32-1).
    (out / "refused_bad_length.msgpack").write_bytes(b"\xdd\xff\xff\xff\xff\x00")


if __name__ == "__main__":
    main()
