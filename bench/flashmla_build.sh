#!/usr/bin/env bash
# Builds FlashMLA's sm90 dense bf16 MLA decode (flash_mla_with_kvcache + get_mla_metadata, page
# size 64) as a benchmark peer for bench/mla_peers.py, from .peers/FlashMLA (fetched, not tracked).
# Result: $FLASHMLA_OUT/flash_mla/ = FlashMLA's own Python package + cuda.py, which loads
# libflashmla_dense.so (the interface does `import flash_mla.cuda`). Run from the repo root:
#   bash bench/flashmla_build.sh            # FLASHMLA_OUT=/tmp/flashmla; then PYTHONPATH=/tmp/flashmla
# A copy prebuilt on the build machine (.peers/flashmla-prebuilt) is used when it loads here;
# FLASHMLA_REBUILD=1 compiles anyway. PREBUILD=1 (with NVCC, TORCH_DIR pointing at a torch wheel's
# unpacked torch/ folder) compiles into .peers/flashmla-prebuilt on a machine without a GPU.
set -euo pipefail
SRC=.peers/FlashMLA
PRE=.peers/flashmla-prebuilt
OUT=${FLASHMLA_OUT:-/tmp/flashmla}
[ -z "${PREBUILD:-}" ] || OUT=$PRE
PKG=$OUT/flash_mla
loads() {  # the op library loads into this python's torch (not checked in PREBUILD mode)
  PYTHONPATH=$OUT python3 -c 'import flash_mla, torch; print("flash_mla ok, torch", torch.__version__)'
}
if [ -z "${PREBUILD:-}${FLASHMLA_REBUILD:-}" ] && [ -f $PRE/flash_mla/libflashmla_dense.so ]; then
  rm -rf "$OUT" && mkdir -p "$OUT" && cp -r $PRE/flash_mla $PRE/STAMP "$OUT"/
  cat $PRE/STAMP || true
  if loads; then exit 0; fi
  echo "prebuilt copy does not load here: compiling"
fi

[ -d $SRC/csrc ] || { echo "no $SRC here: carry all of .peers to compile FlashMLA"; exit 1; }
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
TORCH_DIR=${TORCH_DIR:-$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')}
B=$OUT/build
rm -rf "$PKG" "$B" && mkdir -p "$PKG" "$B/shim/torch"
cp $SRC/flash_mla/*.py "$PKG"/

# torch/extension.h and kerutils' torch/python.h pull in Python.h; the dense path needs neither
# Python nor pybind, so both resolve to torch/all.h and the op is registered with TORCH_LIBRARY:
# the library then fits any Python of the same torch (and builds where no python3.12 headers exist).
for h in extension python; do echo '#include <torch/all.h>' > "$B/shim/torch/$h.h"; done
# Our binding (replaces FlashMLA's api.cpp, which also binds sparse/sm100 code we do not build):
# dense_attn_decode_interface is FlashMLA's, adapted only to a torch-op-friendly signature.
cat > "$B/ops.cpp" <<'EOF'
#include "api/dense_decode.h"
#include <torch/library.h>
static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dense_decode_fwd(
    at::Tensor q, const at::Tensor &kcache, int64_t head_size_v, const at::Tensor &seqlens_k,
    const at::Tensor &block_table, double softmax_scale, bool is_causal,
    std::optional<at::Tensor> tile_scheduler_metadata, std::optional<at::Tensor> num_splits) {
  auto [out, lse, meta, splits] = dense_attn_decode_interface(q, kcache, (int)head_size_v,
      seqlens_k, block_table, (float)softmax_scale, is_causal, tile_scheduler_metadata, num_splits);
  return {out, lse, *meta, *splits};
}
TORCH_LIBRARY(flash_mla, m) { m.def("dense_decode_fwd", &dense_decode_fwd); }
EOF
cat > "$PKG/cuda.py" <<'EOF'
# stands in for FlashMLA's pybind module: the ops live in a torch op library (bench/flashmla_build.sh)
import os
import torch
torch.ops.load_library(os.path.join(os.path.dirname(__file__), "libflashmla_dense.so"))
dense_decode_fwd = torch.ops.flash_mla.dense_decode_fwd
EOF

INC="-I$SRC/csrc -I$SRC/csrc/kerutils/include -I$SRC/csrc/sm90 -I$SRC/csrc/cutlass/include
     -I$SRC/csrc/cutlass/tools/util/include -I$CUDA_HOME/include"
# FlashMLA's setup.py nvcc flags, sm90a only; FLASH_MLA_DISABLE_FP16 (its own switch) skips fp16
NVFLAGS="-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
  --ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage,--warn-on-double-precision-use
  -lineinfo --source-in-ptx -DFLASH_MLA_DISABLE_FP16 -gencode arch=compute_90a,code=sm_90a
  -Xcompiler -fPIC"
# the sources setup.py lists for the sm90 dense decode: scheduler metadata, split-KV kernel, combine
CU="smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu smxx/decode/combine/combine.cu
    sm90/decode/dense/instantiations/bf16.cu"
t0=$(date +%s)
pids=()
for f in $CU; do  # in parallel: bf16.cu is the long pole (minutes), the rest take seconds
  o=$B/$(basename "$f" .cu).o
  $NVCC $NVFLAGS $INC -c $SRC/csrc/$f -o "$o" > "$o.log" 2>&1 & pids+=($!)
done
# host side: cccl is what nvcc adds itself; torch's pip CUDA headers stand in for a toolkit
# without cuBLAS/cuSOLVER/cuSPARSE headers (ATen/cuda/CUDAContext.h includes them)
${CXX:-g++} -O3 -std=c++20 -DNDEBUG -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -Wno-deprecated-declarations \
  -DFLASH_MLA_DISABLE_FP16 -I"$B/shim" $INC -isystem "$CUDA_HOME/include/cccl" \
  -isystem "$TORCH_DIR/include" -isystem "$TORCH_DIR/include/torch/csrc/api/include" \
  -isystem "$TORCH_DIR/../nvidia/cu13/include" -c "$B/ops.cpp" -o "$B/ops.o" > "$B/ops.o.log" 2>&1 &
pids+=($!)
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail = 1 ]; then tail -n 30 "$B"/*.log; exit 1; fi
grep -hE "Used [0-9]+ registers|spill" "$B/bf16.o.log" | sort | uniq -c | head -8
# libtorch, libc10 and libcudart are already loaded by `import torch`; no rpath needed
${CXX:-g++} -shared -o "$PKG/libflashmla_dense.so" "$B"/*.o -L"$TORCH_DIR/lib" -lc10 -lc10_cuda \
  -ltorch_cpu -ltorch_cuda -ltorch -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib" \
  -L"$TORCH_DIR/../nvidia/cu13/lib" -l:libcudart.so.13
echo "FlashMLA dense decode built in $(( $(date +%s) - t0 )) s -> $PKG"
printf 'FlashMLA %s, torch %s, %s\n' "$(cat $SRC/COMMIT 2>/dev/null || echo '?')" \
  "$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$TORCH_DIR/version.py")" \
  "$($NVCC --version | tail -1)" | tee "$OUT/STAMP"
rm -rf "$B"
[ -n "${PREBUILD:-}" ] || loads
