#!/usr/bin/env node
// One measurement of a deltaship ONNX bundle in onnxruntime-node, through the JS driver apps embed
// (deltaship/apps/js/src/node.js), with bench/tools/peer_worker.py's workload and JSON line: a 16-token warmup
// prefill, prefills of 128 and 512 random token ids, then 64 greedy decode steps; peak RSS is VmHWM.
//   node bench/tools/ort_node_worker.mjs BUNDLE_DIR THREADS
// peer_worker.py's tool `ort-node` execs this (memory_peers.py --peer "LABEL=ort-node:BUNDLE").
import { readFileSync } from 'node:fs';
import { openBundle, sample } from '../../deltaship/apps/js/src/node.js';

const [dir, threads] = process.argv.slice(2);
const now = () => Number(process.hrtime.bigint()) / 1e9;
// VmHWM of this process (Linux), as peer_worker.py reads it: getrusage's maxrss would survive the exec from Python
const peak = () => Number(/VmHWM:\s+(\d+)/.exec(readFileSync('/proc/self/status', 'utf8'))[1]) * 1024;
let seed = 0;
const ids = (n) => Array.from({ length: n }, () => (seed = (seed * 1103515245 + 12345) % 2 ** 31) % 1000);

let t0 = now();
const session = await openBundle(dir, { threads: Number(threads) }); // the driver's own options, as an app gets them
const out = { tool: 'ort-node', load_s: now() - t0 };
await session.prefill(ids(16)); // warm up threads and allocations
let logits = null;
for (const p of [128, 512]) {
  session.reset();
  const prompt = ids(p);
  t0 = now();
  logits = await session.prefill(prompt);
  const t1 = now();
  sample(logits);
  out[`prefill_${p}_tok_s`] = p / (t1 - t0);
  out[`ttft_${p}_s`] = now() - t0;
}
const stamps = [];
let tok = sample(logits);
for (let i = 0; i < 64; i++) {
  stamps.push(now());
  tok = sample(await session.decode(tok));
}
stamps.push(now());
out.decode_tok_s = 63 / (stamps[stamps.length - 1] - stamps[1]);
out.peak_rss_bytes = peak();
console.log(JSON.stringify(out));
