#!/bin/bash
# alternate baseline (commit 3410174, its own extension build) and this tree; peer_engine as served, 2 threads
. /work/venv/bin/activate
cd /work/wt/speed32
for rep in 1 2; do
  for tree in base new; do
    if [ $tree = base ]; then dir=/tmp/speed32/base; tx=/tmp/tx_speed32_base; else dir=/work/wt/speed32; tx=/tmp/tx_speed32; fi
    echo "== rep $rep $tree load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $dir && OMP_NUM_THREADS=${THREADS:-1} TORCH_EXTENSIONS_DIR=$tx EDGEINFER_CPU_KERNELS=ext PYTHONPATH=$dir timeout 600 python benchmarks/peer_engine.py --pp 512 --tg 128 --npp 128 --ntg 64 --npl 1,8,32 --reps 2 2>/dev/null | tail -1)
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg)"
