// The read floor of a shuffled page pool: how fast plain loads read the K and V rows a decode
// needs when the pool's pages are shuffled, next to the same kernel reading them in order.
// It separates what scattered pages cost the memory system from what they cost our pipeline.
//
//   nvcc -O3 -arch=sm_90a -o gather_floor bench/gather_floor.cu
//   ./gather_floor [batch L hkv d]    (default 32 32768 8 128)
//
// One line per layout, reader, loads in flight and grid. Layouts: the pool is K and V of
// [pages, page_size, hkv, d] 2-byte elements, each request's pages handed out in a shuffled
// order (the benchmark's pools) or in pool order, or one contiguous cache. Readers: `head`
// reads each (request, KV head) item's rows position by position (d * 2 bytes a position, the
// order the decode reads them); `position` reads all KV heads of a position together
// (hkv * d * 2 contiguous bytes). Each lane keeps UNROLL 16-byte loads of K and as many of V in
// flight; times are the median of six launches, bandwidth counts K and V bytes once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

constexpr int TILE = 64;  // positions per work item

struct Pool {
    const uint4* k;
    const uint4* v;
    const int* table;  // [batch, pages_per_request]
    int batch, len, hkv, row_chunks, page_shift, pages_per_request;
};

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Lane chunk c of an item is 16-byte chunk `c % span` of the item's position `c / span`, where a
// span is one head's row, or with ALL_HEADS every head's row of the position.
template <int UNROLL, bool ALL_HEADS>
__global__ void __launch_bounds__(256) gather(Pool p, unsigned* sink) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int warps = (gridDim.x * blockDim.x) >> 5;
    const int span = ALL_HEADS ? p.hkv * p.row_chunks : p.row_chunks;  // chunks per position
    const int heads = ALL_HEADS ? 1 : p.hkv;
    const int tiles = p.len / TILE;
    const long items = (long)p.batch * heads * tiles;
    const int page_mask = (1 << p.page_shift) - 1;
    const int item_chunks = TILE * span;
    unsigned acc = 0;
    for (long it = warp; it < items; it += warps) {
        const int tile = it % tiles;
        const int head = (it / tiles) % heads;
        const int b = it / ((long)tiles * heads);
        const int* table = p.table + (long)b * p.pages_per_request;
        for (int c0 = 0; c0 < item_chunks; c0 += 32 * UNROLL) {
            uint4 kr[UNROLL], vr[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c < item_chunks) {
                    const int pos = tile * TILE + c / span;
                    const long slot = ((long)table[pos >> p.page_shift] << p.page_shift) | (pos & page_mask);
                    const long at = (slot * p.hkv + head) * p.row_chunks + c % span;
                    kr[u] = ld_stream(p.k + at);
                    vr[u] = ld_stream(p.v + at);
                } else {
                    kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc ^= kr[u].x ^ kr[u].w ^ vr[u].y ^ vr[u].z;
        }
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

int main(int argc, char** argv) {
    const int batch = argc > 1 ? atoi(argv[1]) : 32;
    const int len = argc > 2 ? atoi(argv[2]) : 32768;
    const int hkv = argc > 3 ? atoi(argv[3]) : 8;
    const int d = argc > 4 ? atoi(argv[4]) : 128;
    const int row_chunks = d * 2 / 16;
    const size_t positions = (size_t)batch * len;
    const size_t chunks = positions * hkv * row_chunks;
    const double bytes = 2.0 * chunks * 16;
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    uint4 *k, *v;
    int* table;
    unsigned* sink;
    CHECK(cudaMalloc(&k, chunks * 16));
    CHECK(cudaMalloc(&v, chunks * 16));
    CHECK(cudaMalloc(&table, positions * sizeof(int)));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(k, 1, chunks * 16));
    CHECK(cudaMemset(v, 2, chunks * 16));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    printf("gpu %s, batch %d, L %d, hkv %d, d %d: %.1f MiB of K and V\n", prop.name, batch, len, hkv, d,
           bytes / (1 << 20));
    for (int page : {1, 16, 64, len}) {
        for (int shuffled = 0; shuffled < 2; ++shuffled) {
            if (page == len && shuffled) continue;
            const int shift = __builtin_ctz(page);
            const int per_request = len / page;
            std::vector<int> order((size_t)batch * per_request);
            std::iota(order.begin(), order.end(), 0);
            if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937_64(7));
            CHECK(cudaMemcpy(table, order.data(), order.size() * sizeof(int), cudaMemcpyHostToDevice));
            Pool p{k, v, table, batch, len, hkv, row_chunks, shift, per_request};
            for (int all_heads = 0; all_heads < 2; ++all_heads) {
                for (int unroll : {4, 8, 16}) {
                    auto kern = all_heads ? (unroll == 4 ? gather<4, true> : unroll == 8 ? gather<8, true> : gather<16, true>)
                                          : (unroll == 4 ? gather<4, false> : unroll == 8 ? gather<8, false> : gather<16, false>);
                    for (int per_sm : {2, 4, 8}) {
                        const int grid = prop.multiProcessorCount * per_sm;
                        std::vector<float> ms;
                        for (int rep = 0; rep < 7; ++rep) {
                            CHECK(cudaEventRecord(e0));
                            kern<<<grid, 256>>>(p, sink);
                            CHECK(cudaEventRecord(e1));
                            CHECK(cudaEventSynchronize(e1));
                            float t;
                            CHECK(cudaEventElapsedTime(&t, e0, e1));
                            if (rep > 0) ms.push_back(t);
                        }
                        CHECK(cudaGetLastError());
                        std::sort(ms.begin(), ms.end());
                        const double us = ms[ms.size() / 2] * 1e3;
                        printf("page %7d %-8s read by %-8s unroll %2d ctas/sm %d: %9.1f us %7.0f GB/s\n", page,
                               page == len ? "contig" : shuffled ? "shuffled" : "ordered", all_heads ? "position" : "head",
                               unroll, per_sm, us, bytes / us * 1e-3);
                    }
                }
            }
        }
    }
    return 0;
}
