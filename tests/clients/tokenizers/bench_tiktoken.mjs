// Throughput baseline for kvr's native tokenizer: tiktoken (its Rust core compiled to WASM, npm
// `tiktoken`) encoding the benchmark texts in tests/data/tokenizers/bench/ with cl100k_base (the
// vocabulary Qwen's is derived from) and o200k_base (gpt-oss's, less its special tokens).
//
// For each (file, encoding): `--warmup` untimed encodes, then `--runs` timed runs, each encoding the
// whole file `reps` times (reps is picked from the warm-up so one run lasts about 0.2 s); prints one
// JSON line with the median run: mb_per_s (10^6 bytes of UTF-8 input per second) and tokens_per_s.
// Single thread: tiktoken's WASM build runs on the calling thread and nothing else runs. The text is
// encoded as ordinary text (encode_ordinary): special-token text, if any, is not treated as special.
//
// Run (Node >= 20): cd tests/clients/tokenizers && npm ci && node bench_tiktoken.mjs [--runs=7] [--warmup=3] [FILE...]
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { get_encoding as getEncoding } from 'tiktoken';

const here = path.dirname(fileURLToPath(import.meta.url));
const benchDir = path.resolve(here, '../../data/tokenizers/bench');
const ENCODINGS = ['cl100k_base', 'o200k_base'];
const TARGET_RUN_SECONDS = 0.2;

function parseArgs(argv) {
  const options = { runs: 7, warmup: 3, files: [] };
  for (const arg of argv) {
    const match = /^--(runs|warmup)=(\d+)$/.exec(arg);
    if (match) options[match[1]] = Number(match[2]);
    else if (arg.startsWith('--')) throw new Error(`unknown option ${arg}`);
    else options.files.push(path.resolve(arg));
  }
  if (options.runs < 5) throw new Error('--runs must be at least 5 (the report is a median)');
  if (options.files.length === 0) {
    options.files = ['prose_en.txt', 'code.txt', 'cjk.txt'].map((name) => path.join(benchDir, name));
  }
  return options;
}

function seconds(start) {
  return Number(process.hrtime.bigint() - start) / 1e9;
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 === 1 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
}

function bench(file, encodingName, options) {
  const text = fs.readFileSync(file, 'utf8');
  const bytes = Buffer.byteLength(text, 'utf8');
  const encoding = getEncoding(encodingName);
  try {
    let tokens = 0;
    let warmSeconds = Infinity;
    for (let i = 0; i < Math.max(1, options.warmup); i += 1) {
      const start = process.hrtime.bigint();
      tokens = encoding.encode_ordinary(text).length;
      warmSeconds = Math.min(warmSeconds, seconds(start));
    }
    const reps = Math.max(1, Math.round(TARGET_RUN_SECONDS / warmSeconds));
    const runs = [];
    for (let run = 0; run < options.runs; run += 1) {
      const start = process.hrtime.bigint();
      for (let rep = 0; rep < reps; rep += 1) {
        if (encoding.encode_ordinary(text).length !== tokens) throw new Error('encoding is not deterministic');
      }
      runs.push(seconds(start) / reps);
    }
    const perEncode = median(runs);
    return {
      file: path.basename(file),
      encoding: encodingName,
      bytes,
      tokens,
      runs: options.runs,
      reps_per_run: reps,
      median_seconds: Number(perEncode.toFixed(6)),
      mb_per_s: Number((bytes / perEncode / 1e6).toFixed(2)),
      tokens_per_s: Math.round(tokens / perEncode),
      node: process.versions.node,
    };
  } finally {
    encoding.free();
  }
}

const options = parseArgs(process.argv.slice(2));
for (const file of options.files) {
  for (const encodingName of ENCODINGS) console.log(JSON.stringify(bench(file, encodingName, options)));
}
