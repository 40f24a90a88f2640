// kvstream kernel primitives: with wgmma.cuh (the warpgroup MMA), the only place where inline
// PTX lives.
//
// Every wrapper is a single instruction (or a tiny retry loop around one) and cites the PTX ISA
// section it comes from, so that a reader can check operand order against the manual. Kernels are
// compiled by NVRTC without toolkit headers, so nothing here includes <cuda_*.h>.
#pragma once

namespace kvs {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

// ---------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------

// 32-bit shared-window address of a generic pointer into shared memory (PTX ISA 9.7.9.23, cvta).
__device__ __forceinline__ u32 smem_addr(const void* ptr) {
    u32 addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(addr) : "l"(ptr));
    return addr;
}

// ---------------------------------------------------------------------------------------------
// mbarrier (PTX ISA 9.7.13.15)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(arrivals));
}

// Makes barrier initialisation visible to the async proxy (bulk copies complete on it).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// ones (bulk copies, TMA) that a barrier hands the memory to (PTX ISA 9.7.13.4.16,
// fence.proxy.async).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Each mbarrier and bulk-copy wrapper also takes shared-window addresses (u32, from smem_addr):
// a loop that works in those converts its pointers once, where a generic pointer costs a
// conversion (the shared window's base, S2R) per use that ptxas may not hoist.

// One arrival that also announces `bytes` of bulk-copy traffic the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
    mbarrier_arrive_expect_tx(smem_addr(bar), bytes);
}

__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) { mbarrier_wait(smem_addr(bar), parity); }

// ---------------------------------------------------------------------------------------------
// Bulk copies (PTX ISA 9.7.9.25.4.1, cp.async.bulk) and L2 policies (9.7.9.17, createpolicy)
// ---------------------------------------------------------------------------------------------

// KV is read exactly once per call: let it leave L2 first so it does not push out Q, the
// partials and the next kernel's weights.
__device__ __forceinline__ u64 l2_policy_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// The same fraction-1 policy with another priority (for loads whose best priority is measured).
__device__ __forceinline__ u64 l2_policy_evict_normal() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ u64 l2_policy_evict_last() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Tensor-map (TMA) load of one 4-D box into shared memory, completing on `bar` as transaction
// bytes (PTX ISA 9.7.9.25.5.1, cp.async.bulk.tensor). Coordinates are innermost first; parts of
// the box outside the tensor are zero-filled and still count towards the transaction bytes.
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* tensor_map, int c0, int c1, int c2,
                                            int c3, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
        :: "r"(dst), "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const void* tensor_map, int c0, int c1,
                                            int c2, int c3, u64* bar, u64 policy) {
    tma_load_4d(smem_addr(dst), tensor_map, c0, c1, c2, c3, smem_addr(bar), policy);
}

// Tensor-map prefetch of one 4-D box into L2 (PTX ISA 9.7.9.25.5.3,
// cp.async.bulk.prefetch.tensor): nothing lands in shared memory and nothing waits for it; parts
// outside the tensor are skipped.
__device__ __forceinline__ void tma_prefetch_l2_4d(const void* tensor_map, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];"
                 :: "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// The same for a 5-D box.
__device__ __forceinline__ void tma_load_5d(u32 dst, const void* tensor_map, int c0, int c1, int c2,
                                            int c3, int c4, u32 bar, u64 policy) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [%0], [%1, {%2, %3, %4, %5, %6}], [%7], %8;"
        :: "r"(dst), "l"(tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar), "l"(policy)
        : "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const void* tensor_map, int c0, int c1,
                                            int c2, int c3, int c4, u64* bar, u64 policy) {
    tma_load_5d(smem_addr(dst), tensor_map, c0, c1, c2, c3, c4, smem_addr(bar), policy);
}

// Bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory, completing on `bar` as transaction bytes (PTX ISA 9.7.9.25.4.1, cp.async.bulk).
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Asynchronous 16-byte copy from global to shared memory through L2 only (PTX ISA 9.7.9.25.3,
// cp.async.cg): `src_bytes` of 16 or 0 (0 reads nothing and writes 16 zeros; `src` must still be
// a valid global address). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, u32 src_bytes, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                 :: "r"(dst), "l"(src), "r"(src_bytes), "l"(policy) : "memory");
}

// Asynchronous 8-byte copy from global to shared memory that may allocate in L1 (PTX ISA
// 9.7.9.25.3, cp.async.ca; .cg takes 16 bytes only). Both addresses 8-byte aligned.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst), "l"(src) : "memory");
}

// Arrival on `bar` once every cp.async this thread issued before has landed, counted against
// the barrier's expected arrivals (.noinc: the barrier is initialised with one arrival per
// copying thread; PTX ISA 9.7.9.25.3.4, cp.async.mbarrier.arrive).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

// Waits until every cp.async this thread issued has landed (PTX ISA 9.7.9.25.3.3,
// cp.async.wait_all).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Prefetch of one global line into L2 through the load/store path (PTX ISA 9.7.9.15,
// prefetch): nothing returns, so nothing waits for it, and the TMA unit is not involved.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(ptr));
}

// 16 bytes of shared memory to or from four registers (PTX ISA 9.7.9.8 ld, 9.7.9.10 st).
__device__ __forceinline__ void ld_shared_v4(u32* r, u32 addr) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void st_shared_v4(u32 addr, const u32* r) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

__device__ __forceinline__ void st_shared_u16(u32 addr, u16 v) {
    asm volatile("st.shared.u16 [%0], %1;" :: "r"(addr), "h"(v) : "memory");
}

// A 32-bit global load cached in L2 only: no L1 line is left that a later load of the same
// address could hit while another kernel rewrites it.
__device__ __forceinline__ int ld_global_l2(const int* ptr) {
    int v;
    asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}

// The same for float and float4: reads of data that other CTAs of this grid wrote (split
// partials), which an L1 line left from an earlier read must not shadow.
__device__ __forceinline__ float ld_global_l2(const float* ptr) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
    return v;
}
__device__ __forceinline__ float2 ld_global_l2(const float2* ptr) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(ptr));
    return v;
}
__device__ __forceinline__ float4 ld_global_l2(const float4* ptr) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(ptr));
    return v;
}

// Adds `v` to a global counter at GPU scope with release semantics, no value returned (PTX ISA
// 9.7.13.6, red; memory model 8.x). Issued by one thread after a bar.sync, its release covers
// what the whole CTA wrote before the barrier (cumulativity): one thread's fence instead of one
// in every thread (`__threadfence` is a sequentially consistent MEMBAR.SC.GPU in each of them).
// Nothing is acquired and the old value is not waited for.
__device__ __forceinline__ void red_add_release_gpu(int* ptr, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

// Adds `v` to a global counter at GPU scope, relaxed (no fence), and returns the old value: for
// counts that order nothing but themselves.
__device__ __forceinline__ int atom_add_relaxed_gpu(int* ptr, int v) {
    int old;
    asm volatile("atom.add.relaxed.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

// A GPU-scope acquire load (PTX ISA 9.7.9.8, ld; memory model 8.x): what the releasers of the
// value read wrote before their release is visible to this thread after it.
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

// Suspends the thread for about `ns` nanoseconds (PTX ISA 9.7.19.4, nanosleep): a polling loop
// that leaves the SM's issue slots to others.
__device__ __forceinline__ void nanosleep(u32 ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

// Pulls a tensor map (a kernel parameter) into the descriptor cache before its first use
// (PTX ISA 9.7.9.26, prefetch.tensormap).
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(tensor_map) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Scheduling
// ---------------------------------------------------------------------------------------------

// An empty volatile asm that reads `v`: `v` is computed before this point, and volatile asm keeps
// its order with other volatile asm (griddepcontrol.wait), so the computation cannot sink below
// a wait that follows.
__device__ __forceinline__ void computed_here(int v) { asm volatile("" :: "r"(v)); }
__device__ __forceinline__ void computed_here(const void* v) { asm volatile("" :: "l"(v)); }

// ---------------------------------------------------------------------------------------------
// Timers and placement (PTX ISA chapter 10, special registers %globaltimer, %clock, %smid): the
// phase trace of KVS_TRACE builds only
// ---------------------------------------------------------------------------------------------

// Nanoseconds on a clock every SM shares, so stamps of different CTAs compare.
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}

// This SM's cycle counter (low 32 bits): finer than the global timer, local to the SM.
__device__ __forceinline__ u32 sm_clock() {
    u32 c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory");
    return c;
}

__device__ __forceinline__ u32 sm_id() {
    u32 id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (PTX ISA 9.7.12.16, griddepcontrol)
// ---------------------------------------------------------------------------------------------

// Waits until the grid this one depends on has completed and its writes are visible. A no-op
// when the kernel was not launched with programmatic stream serialization.
__device__ __forceinline__ void pdl_wait_for_producer() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// Lets the next kernel in the stream launch once every CTA of this grid has called it (or
// exited); that kernel's pdl_wait_for_producer still waits for our completion and the visibility
// of our writes, so calling this early is always safe and only moves its launch off the
// critical path.
__device__ __forceinline__ void pdl_release_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters and distributed shared memory (PTX ISA 9.7.13.3 barrier.cluster,
// 9.7.9.15 mapa, 9.7.9.9 st with .shared::cluster, 10.12 %cluster_ctarank)
// ---------------------------------------------------------------------------------------------

// This CTA's rank inside its cluster (0 .. cluster size - 1).
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Cluster-wide barrier in two halves. Every thread of every CTA of the cluster must arrive once
// per phase; `wait` returns when all have arrived. The release / acquire pair makes the
// shared-memory writes (local or remote) made before the arrive visible after the wait.
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
// Relaxed: orders nothing, only counts; used to learn that every peer has started.
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}

// Address of the same shared-memory location in the CTA of cluster rank `rank`.
__device__ __forceinline__ u32 peer_smem_addr(u32 local_addr, u32 rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local_addr), "r"(rank));
    return remote;
}

// Stores into a peer's shared memory: fire and forget, made visible by the next cluster barrier.
__device__ __forceinline__ void st_peer_f32(u32 cluster_addr, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_peer_f32x2(u32 cluster_addr, float a, float b) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(cluster_addr), "f"(a), "f"(b)
                 : "memory");
}

// ---------------------------------------------------------------------------------------------
// Register budgets per warpgroup (PTX ISA 9.7.19.5, setmaxnreg, sm_90a): every warp of a
// warpgroup executes the same one; takes effect only under __launch_bounds__(threads, 1)
// ---------------------------------------------------------------------------------------------

// The registers a CTA of `threads` threads (one a SM) is launched with, per thread: a
// warpgroup's setmaxnreg.inc only takes registers the others gave back, so the budgets after
// the exchange must fit in threads x this, or the increase waits forever.
__host__ __device__ constexpr int launch_registers(int threads) { return 65536 / threads / 8 * 8 < 255 ? 65536 / threads / 8 * 8 : 255; }
// Do warpgroups of 128 threads holding `regs[i]` registers fit the launch's pool?
__host__ __device__ constexpr bool fits_launch_registers(int threads, int producer_regs, int consumer_groups, int consumer_regs) {
    return 128 * producer_regs + 128 * consumer_groups * consumer_regs <= threads * launch_registers(threads) &&
           threads == 128 * (1 + consumer_groups);
}

template <u32 REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS));
}
template <u32 REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS));
}

// ---------------------------------------------------------------------------------------------
// Named barriers (PTX ISA 9.7.13.4, bar.sync): id 0 is __syncthreads
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Warp-level matrix fragments (PTX ISA 9.7.14.5.15 ldmatrix, 9.7.14.5.16 movmatrix,
// 9.7.14.5.14 mma.m16n8k16)
// ---------------------------------------------------------------------------------------------

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The inverse of ldmatrix_x4 (PTX ISA 9.7.14.5.17, stmatrix): four 8x8 b16 matrices from the
// fragment layout of an MMA accumulator (lane l holds row l / 4, elements 2 (l % 4) and + 1, of
// each) to shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Same, each matrix transposed on the way into registers.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Transposes one 8x8 b16 matrix held in the ldmatrix fragment layout, in registers.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

// D (16x8 f32) += A (16x16, row) * B (16x8, col), 16-bit inputs of type T (bf16 or f16).
template <bool IS_F16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (IS_F16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
            " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
            " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// ---------------------------------------------------------------------------------------------
// Numbers (PTX ISA 9.7.3.22 ex2, 9.7.9.21 cvt, 9.7.8.7 prmt; rcp.approx)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 1 / x to about 1 ulp; 1 / inf = 0
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Packs two floats into a 16-bit pair, `lo` in the low half (round to nearest even).
template <bool IS_F16>
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 r;
    if (IS_F16) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// The two floats of a 16-bit pair, `lo` from the low half (exact).
template <bool IS_F16>
__device__ __forceinline__ void unpack_half2(u32 x, float& lo, float& hi) {
    if (IS_F16) {
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
            : "=f"(lo), "=f"(hi) : "r"(x));
    } else {
        lo = __uint_as_float(x << 16);
        hi = __uint_as_float(x & 0xffff0000u);
    }
}

// Four e4m3 bytes to two f16 pairs, exactly: bytes 0, 1 into `lo` (byte 0 in its low half),
// bytes 2, 3 into `hi` (sm_89 and later).
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 x, u32& lo, u32& hi) {
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi) : "r"(x));
}

// Byte i of the result is byte (sel >> 4 i) & 7 of {b, a} (PTX ISA 9.7.8.7 prmt, default mode).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

}  // namespace kvs
