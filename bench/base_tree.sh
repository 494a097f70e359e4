#!/usr/bin/env bash
# The code of another commit, for `bash bench/gpu_run.sh ab` to serve beside the working tree's on one
# machine: what the server runs at REV (service, package, bento files, the benchmarks and the test
# helper they import) in .serve_whl/base, which device calls carry (.serve_whl is ignored by git).
#   bash bench/base_tree.sh e72a49a
set -eu
rev=${1:?usage: bash bench/base_tree.sh REV}
rm -rf .serve_whl/base
mkdir -p .serve_whl/base
git archive "$rev" service.py bentofile.yaml requirements.txt llgtrt_core bench tests/bento_server.py | tar -x -C .serve_whl/base
git rev-parse --short "$rev" > .serve_whl/base/REVISION
echo "$(cat .serve_whl/base/REVISION) in .serve_whl/base ($(du -sh .serve_whl/base | cut -f1))"
