// Warpgroup-level MMA (PTX ISA 9.7.15, wgmma; sm_90a): the wrappers and the shared-memory
// matrix descriptors the compute-bound kernels feed them. Same rules as ptx.cuh: one instruction
// per wrapper, the manual's section cited, no toolkit headers.
//
// Accumulator layout of m64nNk16 (f32, N/2 registers a thread): thread t of the warpgroup, warp
// w = t / 32, lane l: d[4 j + 2 i + c] is row 16 w + l / 4 + 8 i, column 8 j + 2 (l % 4) + c
// (the m16n8 layout of mma.sync, stacked over the four warps).
#pragma once

#include "ptx.cuh"

namespace kvs {

// Descriptor of a shared-memory operand in the 128-byte swizzle (9.7.15.5.1.2): rows of 128
// bytes whose 16-byte chunk c of row r sits at chunk c ^ (r % 8), as the TMA's 128-byte swizzle
// writes it; the operand's 1024-byte pattern blocks must start 1024-byte aligned (base offset 0).
//   K-major (rows are M or N, 64 two-byte k per row): `stride` = bytes from 8 rows to the next 8;
//     `leading` is unused (1); a k16 step further along the row adds 32 bytes to the address.
//   MN-major (rows are k, 64 two-byte M or N per row): `stride` = bytes from 8 k to the next 8,
//     `leading` = bytes from 64 M or N to the next 64.
__device__ __forceinline__ u64 smem_desc_sw128(u32 addr, u32 leading, u32 stride) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)((leading >> 4) & 0x3fffu) << 16) |
           ((u64)((stride >> 4) & 0x3fffu) << 32) | (1ull << 62);
}

// Orders this warpgroup's register accesses before the wgmma operations that follow (9.7.15.7.1).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Closes the group of wgmma operations issued since the last commit (9.7.15.7.2).
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups are pending (9.7.15.7.3).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across a wgmma issue or wait.
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// D (64 x N, f32) = A (64 x 16) B (16 x N) + (accumulate ? D : 0), A and B in shared memory
// (9.7.15.5.2): A K-major, B K-major (TRANS_B 0) or N-major (TRANS_B 1); f16 or bf16 inputs.
#define KVS_WGMMA_M64N64K16(TYPES)                                                                   \
    asm volatile(                                                                                \
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32" TYPES " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, %32, %33, p, 1, 1, 0, %35; }"                                      \
        : \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(a), "l"(b), "r"((u32)accumulate), "n"(TRANS_B))

template <bool IS_F16, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], u64 a, u64 b, bool accumulate) {
    if constexpr (IS_F16) {
        KVS_WGMMA_M64N64K16(".f16.f16");
    } else {
        KVS_WGMMA_M64N64K16(".bf16.bf16");
    }
}
#undef KVS_WGMMA_M64N64K16

#define KVS_WGMMA_M64N256K16(TYPES)                                                                   \
    asm volatile(                                                                                \
        "{ .reg .pred p; setp.ne.b32 p, %130, 0; wgmma.mma_async.sync.aligned.m64n256k16.f32" TYPES " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
        "}, %128, %129, p, 1, 1, 0, %131; }"                                      \
        : \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(a), "l"(b), "r"((u32)accumulate), "n"(TRANS_B))

template <bool IS_F16, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 a, u64 b, bool accumulate) {
    if constexpr (IS_F16) {
        KVS_WGMMA_M64N256K16(".f16.f16");
    } else {
        KVS_WGMMA_M64N256K16(".bf16.bf16");
    }
}
#undef KVS_WGMMA_M64N256K16

// D (64 x N, f32) = A (64 x 16, registers) B (16 x N, shared memory) + (accumulate ? D : 0)
// (9.7.15.5.2): A in the register fragment of the m16n8k16 A operand stacked over the four
// warps (warp w holds rows 16 w ..), which is the accumulator layout above packed in pairs, so a
// softmax of S feeds P V without leaving the registers; B K-major (TRANS_B 0) or N-major (1).
#define KVS_WGMMA_M64N64K16_RS(TYPES)                                                               \
    asm volatile(                                                                                \
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32" TYPES " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38; }"                             \
        : \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"((u32)accumulate), "n"(TRANS_B))

template <bool IS_F16, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const u32 (&a)[4], u64 b, bool accumulate) {
    if constexpr (IS_F16) {
        KVS_WGMMA_M64N64K16_RS(".f16.f16");
    } else {
        KVS_WGMMA_M64N64K16_RS(".bf16.bf16");
    }
}
#undef KVS_WGMMA_M64N64K16_RS

#define KVS_WGMMA_M64N128K16_RS(TYPES)                                                               \
    asm volatile(                                                                                \
        "{ .reg .pred p; setp.ne.b32 p, %69, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32" TYPES " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70; }"                             \
        : \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"((u32)accumulate), "n"(TRANS_B))

template <bool IS_F16, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const u32 (&a)[4], u64 b, bool accumulate) {
    if constexpr (IS_F16) {
        KVS_WGMMA_M64N128K16_RS(".f16.f16");
    } else {
        KVS_WGMMA_M64N128K16_RS(".bf16.bf16");
    }
}
#undef KVS_WGMMA_M64N128K16_RS

}  // namespace kvs
