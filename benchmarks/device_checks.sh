#!/usr/bin/env bash
# Every check that needs a GPU, in one run on a CUDA machine whose Python has torch but
# not Pyro and no network (docs/benchmarks.md, sections 5, 7 and 10). From the repository root:
#
#   bash benchmarks/device_checks.sh WHEEL_FOLDER OUT_FOLDER
#
# WHEEL_FOLDER holds pyro-ppl and pyro-api wheels for that Python (see the docstring of
# benchmarks/gpu.py); results land in OUT_FOLDER: the CUDA tests, the GPU benchmark
# table, the spatial-domains figures and timings at 20k and 150k spots, MF-WGF's step cost, and
# issue 13's generic suite on the GPU (sections 5, 7, 10, 12d and 14; on an H200 on 2026-12-04
# the first four parts took 124 s and the suite 176 s, where the parts' own time limits add up
# to 14 minutes: give the device call an outer `timeout` under its 10-minute limit). The device
# tool returns at most 8 files: run it with OUT_FOLDER outside $OUT and tar it into $OUT.
set -uo pipefail
wheels=${1:?give the folder of wheel files}
out=${2:?give the output folder}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import sys, torch, pyro; print(sys.version.split()[0], torch.__version__, pyro.__version__)"
} | tee "$out/machine.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/mfwgf/test_cuda.py \
    tests/spatial/test_fit.py -k cuda 2>&1 | tee "$out/pytest_cuda.txt"
timeout 200 python3 benchmarks/gpu.py --device cuda --budget 160 --out "$out" \
    2>&1 | tee "$out/gpu_benchmark.txt"
# One tissue per size, the default method only: the full benchmark's 5 seeds x 3 tissues take
# longer than this script's share of a lent device.
timeout 150 python3 benchmarks/spatial_domains.py --device cuda --quiet --seeds 1 --generators potts \
    --num-spots 20000 150000 --methods P2D-VI --out "$out/spatial" 2>&1 | tee "$out/spatial_domains.txt"
# MF-WGF's cost against particles and dimension (section 12d) on the GPU.
timeout 90 python3 benchmarks/mfwgf.py --device cuda --sections scaling --quiet --out "$out/mfwgf" \
    2>&1 | tee "$out/mfwgf_scaling.txt"
# Issue 13's six small models and the Poisson model of 13zo (its sites whitened together, the
# large one measured by probes) on the GPU, one seed, 10 s each (section 14), the references on
# the CPU.
timeout 270 python3 benchmarks/suite.py --models logreg,ppca,mixed,hier,scale,odlogit,poisson \
    --budget-seconds 10 --svi-lrs 0.01 --decay-lr 0 --pdvi-configs defaults --eta-grid "" \
    --checkpoints 2.5,5,10 --seeds 0 --threads 1 --no-plots --device cuda --out "$out/suite" \
    > "$out/suite_log.txt" 2>&1
tail -n 40 "$out/suite_log.txt"
