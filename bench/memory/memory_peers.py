"""Peak RSS of deltaship on main (its one-file int4 bundle), this branch and onnxruntime-genai int4, alternating.

    python bench/memory_peers.py ROUNDS OUT_JSON

bench/peer_worker.py per measurement (a fresh process each). Paths are those of docs/results/memory.md's run:
edit TOOLS for yours (the genai venv and model come from bench/peers.py's build).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

W = str(Path(__file__).with_name("peer_worker.py"))
TOOLS = {
    "deltaship onnx int4 (main, one-file bundle)": (
        "/work/main/.venv/bin/python",
        "deltaship",
        "/tmp/mem/b08-int4",
        "/work/main",
    ),
    "deltaship onnx int4 (this branch)": (
        "/work/main/.venv/bin/python",
        "deltaship",
        "/tmp/mem/b08-int4-ext",
        "/work/wt-memory",
    ),
    "onnxruntime-genai int4": (
        "/tmp/deltaship-bench/peers/genai-venv/bin/python",
        "genai",
        "/tmp/deltaship-bench/peers/genai-int4",
        "",
    ),
}
rounds = int(sys.argv[1])
out = sys.argv[2]
samples = {k: [] for k in TOOLS}
for r in range(rounds):
    for name, (py, tool, path, pp) in TOOLS.items():
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=pp)
        p = subprocess.run([py, W, tool, path, "2"], capture_output=True, text=True, env=env)
        if p.returncode:
            print(name, "died", p.stderr[-400:], flush=True)
            continue
        res = json.loads(p.stdout.strip().splitlines()[-1])
        samples[name].append(res)
        print(r, name, {k: round(v, 3) for k, v in res.items() if k != "tool"}, flush=True)
        json.dump(
            {
                "command": "python bench/memory_peers.py %d %s" % (rounds, out),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "samples": samples,
            },
            open(out, "w"),
            indent=1,
        )
