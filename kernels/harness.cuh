// Shared by gemv_codebook_4bit.cu and gemv_codebook.cu: the device pieces both formats use
// (streaming loads, the tensor-core instruction, the split-K epilogue, the reference dequantizer)
// and the host harness (data, cuBLAS and float64 references, plans, CUDA-graph timing, report).
// The GEMV kernels themselves live in the two .cu files.
//
// Format (trapetum/codebook.py): W[o, i] = C[o, q[o, i]], C fp16 (out x K). Kernel layout: rows in
// row-blocks of 32 (out padded with zero codes and zero codebooks), each row's code bytes in
// 16-byte chunks, tiled[((rb * nchunks + j) * 32 + lane) * 16 + t] = packed[rb*32 + lane][j*16 + t];
// codebooks tiled as cbt[rb][k][lane] fp16 (trapetum.codebook.tile), so a block copies its rows'
// tables with coalesced 16-byte loads.
#pragma once

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <map>
#include <set>
#include <string>
#include <vector>

#define TP_CHECK(call)                                                                        \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                                \
    }                                                                                         \
  } while (0)

#define TP_CUBLAS(call)                                                                          \
  do {                                                                                           \
    cublasStatus_t s_ = (call);                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                           \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cublasGetStatusString(s_)); \
      exit(2);                                                                                   \
    }                                                                                            \
  } while (0)

// After every launch: a bad configuration shows up here, not as silently missing output.
#define TP_LAUNCHED() TP_CHECK(cudaGetLastError())

namespace tp {

constexpr int kRowBlock = 32;    // rows a warp owns: lane l <-> row rb*32 + l
constexpr int kChunk = 16;       // bytes one lane loads at once
constexpr int kMmaUnroll = 4;    // chunks a warp of the mma kernels keeps in flight (x2 while refilling)
constexpr double kTolerance = 2e-3;  // fp16 output rounding is 2^-11 of the largest output
constexpr const char* kMethod = "cuda-graph replay, CUDA events, median, L2-rotated";

struct GemvParams {
  const uint4* codes;  // tiled codes
  const uint4* cb;     // tiled codebooks [rb][K][32] fp16
  const uint4* x;      // [B][n_in] fp16, rows 16-byte aligned
  __half* y;           // [B][n_out] fp16
  float* ws;           // [ksplit][B][n_out] fp32: K-slice partials
  unsigned* counters;  // one per block column, zero between launches
  int B, n_in, n_out, rbs, nchunks, cps;
};
using KernelFn = void (*)(GemvParams);

// ---------------------------------------------------------------------------------------------
// Device pieces
// ---------------------------------------------------------------------------------------------

// Codes are read exactly once: keep them out of L1. volatile: never speculated past its guard.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Shared loads at a shared-window address (volatile: never hoisted above the barrier that
// published what they read).
__device__ __forceinline__ uint32_t lds32(uint32_t a) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int k) {  // k is a constant after unrolling
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// D += A (16x16 fp16, row) * B (16x8 fp16, col), fp32 accumulators (PTX ISA "mma.m16n8k16").
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Sums the per-warp partials in `red` and finishes the block's RB row-blocks: y directly when the
// grid has one K-slice, otherwise fp32 partials to ws, and the last block of a row-block column to
// arrive (atomic counter) adds them up in slice order (deterministic) and resets the counter, so
// the launch can be replayed in a CUDA graph.
//   SPLIT_WARPS: partial set w only holds rows of row-block w % RB, red[w][b][32] (the mma
//   kernels: NP sets, one a warp, or two a warp where every warp streams both row-blocks);
//   otherwise every warp holds every row-block, red[w][r][b][32] (the lut kernel).
template <int RB, int W, bool SPLIT_WARPS, int NP = W>
__device__ __forceinline__ void finish_rows(const float* red, const GemvParams& p, int* s_last) {
  const int tid = threadIdx.x, bx = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y, B = p.B;
  const int items = RB * B * 32;
  for (int it = tid; it < items; it += W * 32) {
    const int r = it & 31, b = (it >> 5) % B, g = (it >> 5) / B;
    float s = 0.f;
    if (SPLIT_WARPS) {
#pragma unroll
      for (int wg = 0; wg < NP / RB; ++wg) s += red[((wg * RB + g) * B + b) * 32 + r];
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) s += red[((w * RB + g) * B + b) * 32 + r];
    }
    const int row = (bx * RB + g) * 32 + r;
    if (row < p.n_out) {
      if (nsplit == 1)
        p.y[(size_t)b * p.n_out + row] = __float2half_rn(s);
      else
        p.ws[((size_t)split * B + b) * p.n_out + row] = s;
    }
  }
  if (nsplit == 1) return;
  __threadfence();  // this thread's partials are visible device-wide before the block counts in
  __syncthreads();
  if (tid == 0) *s_last = atomicAdd(&p.counters[bx], 1u) == (unsigned)(nsplit - 1);
  __syncthreads();
  if (!*s_last) return;
  __threadfence();
  for (int it = tid; it < items; it += W * 32) {
    const int r = it & 31, b = (it >> 5) % B, g = (it >> 5) / B;
    const int row = (bx * RB + g) * 32 + r;
    if (row < p.n_out) {
      float s = 0.f;
      for (int sp = 0; sp < nsplit; ++sp) s += __ldcg(p.ws + ((size_t)sp * B + b) * p.n_out + row);
      p.y[(size_t)b * p.n_out + row] = __float2half_rn(s);
    }
  }
  if (tid == 0) p.counters[bx] = 0;
}

// Reference dequantizer: natural layout -> fp16 W (out x in), 8 columns a thread, grid-stride.
template <int K>
__global__ void dequant_kernel(const uint8_t* __restrict__ packed, const __half* __restrict__ C,
                               __half* __restrict__ W, int n_out, int n_in) {
  const size_t n8 = (size_t)n_out * n_in / 8;
  for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < n8; t += (size_t)gridDim.x * blockDim.x) {
    const size_t e = t * 8;
    const int o = (int)(e / n_in), i = (int)(e % n_in);
    const __half* c = C + (size_t)o * K;
    __align__(16) __half v[8];
    if (K == 16) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(packed + (size_t)o * (n_in / 2) + i / 2);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = c[(w >> (4 * k)) & 15u];
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(packed + (size_t)o * n_in + i);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = c[((k < 4 ? w.x : w.y) >> (8 * (k & 3))) & 255u];
    }
    *reinterpret_cast<uint4*>(W + e) = *reinterpret_cast<const uint4*>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Host: shapes, plans
// ---------------------------------------------------------------------------------------------

struct DeviceInfo {
  cudaDeviceProp prop;
  int sms = 0;
  size_t l2 = 0;
  size_t smem_optin = 0;
};

struct Shape {
  int n_in, n_out, K;
  int bits;      // 4 or 8 bits a code
  int in_bytes;  // code bytes a row
  int nchunks;   // 16-byte chunks a row
  int rbs;       // row-blocks
  int cols_per_chunk;
  Shape(int in, int out, int k) : n_in(in), n_out(out), K(k) {
    bits = K == 16 ? 4 : 8;
    in_bytes = bits == 4 ? in / 2 : in;
    nchunks = in_bytes / kChunk;
    rbs = (out + kRowBlock - 1) / kRowBlock;
    cols_per_chunk = kChunk * 8 / bits;
  }
  size_t code_bytes() const { return (size_t)n_out * in_bytes; }
  size_t cb_bytes() const { return (size_t)n_out * K * 2; }
};

struct Plan {
  KernelFn fn = nullptr;
  int warps = 0, ksplit = 0, cps = 0, rb = 1;  // rb: row-blocks a block
  int gridx = 0;
  size_t smem = 0;  // dynamic shared bytes
  int occupancy = 0;  // blocks an SM
  std::string key() const {
    char b[96];
    snprintf(b, sizeof b, "rb%d w%d ks%d", rb, warps, ksplit);
    return b;
  }
};

struct Request {  // plan overrides (0 = choose)
  int warps = 0, ksplit = 0, rb = 0;
};

inline int cdiv(long long a, long long b) { return (int)((a + b - 1) / b); }

// Raises the kernel's dynamic shared-memory limit to what the device allows (once) and returns
// its occupancy at `smem` bytes, 0 if it cannot launch.
inline int occupancy(KernelFn fn, int threads, size_t smem, const DeviceInfo& d) {
  // The opt-in limit covers static and dynamic shared memory together: a kernel with a static
  // __shared__ variable may raise its dynamic limit only to the opt-in minus that.
  static std::map<const void*, size_t> dyn_max;
  auto it = dyn_max.find((const void*)fn);
  if (it == dyn_max.end()) {
    cudaFuncAttributes a;
    TP_CHECK(cudaFuncGetAttributes(&a, (const void*)fn));
    const size_t m = d.smem_optin > a.sharedSizeBytes ? d.smem_optin - a.sharedSizeBytes : 0;
    TP_CHECK(cudaFuncSetAttribute((const void*)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)m));
    it = dyn_max.emplace((const void*)fn, m).first;
  }
  if (smem > it->second) return 0;
  int n = 0;
  TP_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem));
  return n;
}

// The numba kernel's plan (trapetum/gemv.py plan_launch at 6b8b229), line for line: RB row-blocks a
// block, 8 warps where the 48 KB shared budget allows, a K-split that gives about two blocks an SM
// while leaving every warp at least 4 chunks.
inline int lut_rb_max(int K, int B) {  // gemv.row_blocks_per_block
  if (K == 256) return 1;
  if (K == 64) return B <= 4 ? 2 : 1;
  return B <= 2 ? 4 : (B <= 8 ? 2 : 1);
}

using LutGetter = KernelFn (*)(int K, int B, int W, int RB);

inline bool plan_lut(const Shape& s, int B, const Request& rq, const DeviceInfo& d, LutGetter get, Plan& pl,
                     std::string& why) {
  const int budget = 48 * 1024, cpb = s.cols_per_chunk;
  const int RB = rq.rb ? rq.rb : lut_rb_max(s.K, B);
  if (RB > lut_rb_max(s.K, B)) { why = "RB above the kernel's limit"; return false; }
  int warps = 0, x_budget = 0;
  const int cands[2] = {8, 4};
  for (int i = 0; i < (rq.warps ? 1 : 2); ++i) {
    const int w = rq.warps ? rq.warps : cands[i];
    const int stat = RB * s.K * 32 * 4 + w * RB * B * 32 * 4 + 16;
    x_budget = budget - stat;
    if (x_budget >= B * cpb * 4 * w) { warps = w; break; }
  }
  if (warps != 4 && warps != 8) { why = "shared memory does not fit 48 KB (or warps not 4/8)"; return false; }
  const int cps_max = x_budget / (B * cpb * 4);
  const int min_split = cdiv(s.nchunks, cps_max);
  int ks = rq.ksplit;
  if (!ks) {
    const int want = cdiv(2 * d.sms, cdiv(s.rbs, RB));
    ks = std::max(std::max(min_split, std::min(want, std::max(1, s.nchunks / (4 * warps)))), 1);
  } else if (ks < min_split) {
    why = "K-slice too wide for shared memory";
    return false;
  }
  ks = std::min(ks, s.nchunks);
  pl.cps = cdiv(s.nchunks, ks);
  pl.ksplit = cdiv(s.nchunks, pl.cps);
  pl.warps = warps;
  pl.rb = RB;
  pl.gridx = cdiv(s.rbs, RB);
  pl.smem = (size_t)RB * s.K * 32 * 4 + (size_t)warps * RB * B * 32 * 4 + (size_t)B * pl.cps * cpb * 4;
  pl.fn = get(s.K, B, warps, RB);
  if (!pl.fn) { why = "no kernel instantiated"; return false; }
  pl.occupancy = occupancy(pl.fn, warps * 32, pl.smem, d);
  if (!pl.occupancy) { why = "does not launch"; return false; }
  return true;
}

inline std::vector<Request> lut_candidates(const Shape& s, int B) {  // gemv.candidate_plans
  std::vector<Request> out;
  for (int RB : {1, 2, 4})
    if (RB <= lut_rb_max(s.K, B))
      for (int ks : {1, 2, 3, 4, 6, 8, 12, 16, 0}) out.push_back({0, ks, RB});
  return out;
}

inline bool lut_keep(const Plan& p) { return p.cps >= 2 * p.warps; }

// The mma kernels: a block owns two row-blocks (64 rows), its warps split between them; a table
// of tab_bytes (aliased by the warp partials after the main loop), cbs_bytes of staged codebooks,
// and B rows of the x slice in fp16, 16 bytes of padding a row so batch rows sit in other banks.
struct MmaGeometry {
  int tab_bytes, cbs_bytes, x_chunk_bytes;
};
using MmaGetter = KernelFn (*)(int K, int B, int W);

inline size_t mma_smem(const MmaGeometry& g, int B, int W, int cps) {
  return (size_t)std::max(g.tab_bytes, W * B * 32 * 4) + (size_t)B * (cps * g.x_chunk_bytes + 16) + g.cbs_bytes;
}

inline bool plan_mma(const Shape& s, int B, const Request& rq, const DeviceInfo& d, const MmaGeometry& g,
                     MmaGetter get, Plan& pl, std::string& why) {
  const int nbx = cdiv(s.rbs, 2);
  int W = rq.warps;
  if (!W) {
    // 8 warps (4 a row-block) unless the layer is too small to give every SM a block that way.
    W = 8;
    if ((long long)nbx * std::max(1, s.nchunks / (4 * 2 * kMmaUnroll)) < d.sms) W = 4;
  }
  if (W != 4 && W != 8 && W != 16) { why = "warps must be 4, 8 or 16"; return false; }
  const int W2 = W / 2;
  const size_t fixed = mma_smem(g, B, W, 0);
  if (fixed + (size_t)B * g.x_chunk_bytes > d.smem_optin) { why = "table does not fit shared memory"; return false; }
  const int cps_max = (int)std::min<size_t>(s.nchunks, ((d.smem_optin - fixed) / B) / g.x_chunk_bytes);
  const int min_split = cdiv(s.nchunks, cps_max);
  KernelFn fn = get(s.K, B, W);
  if (!fn) { why = "no kernel instantiated"; return false; }
  int ks = rq.ksplit;
  if (!ks) {
    // Smallest K-split giving about two waves of blocks (the block scheduler then evens out the
    // SMs), but every warp keeps two full pipeline turns: the table build (64 KB of shared stores
    // for 4-bit) has to be paid back by the stream.
    const int max_split = std::max(min_split, s.nchunks / (W2 * 2 * kMmaUnroll));
    for (ks = min_split; ks < max_split; ++ks) {
      const int cps = cdiv(s.nchunks, ks);
      const int occ = occupancy(fn, W * 32, mma_smem(g, B, W, cps), d);
      if ((long long)nbx * cdiv(s.nchunks, cps) >= 2LL * std::max(occ, 1) * d.sms) break;
    }
  } else if (ks < min_split) {
    why = "K-slice too wide for shared memory";
    return false;
  }
  ks = std::min(ks, s.nchunks);
  pl.cps = cdiv(s.nchunks, ks);
  pl.ksplit = cdiv(s.nchunks, pl.cps);
  pl.warps = W;
  pl.rb = 2;
  pl.gridx = nbx;
  pl.smem = mma_smem(g, B, W, pl.cps);
  pl.fn = fn;
  pl.occupancy = occupancy(fn, W * 32, pl.smem, d);
  if (!pl.occupancy) { why = "does not launch (shared memory or registers)"; return false; }
  return true;
}

inline std::vector<Request> mma_candidates(const Shape&, int) {
  std::vector<Request> out;
  for (int W : {4, 8, 16})
    for (int ks : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 0}) out.push_back({W, ks, 0});
  return out;
}

inline bool mma_keep(const Plan& p) { return p.cps >= (p.warps / 2) * kMmaUnroll; }

// ---------------------------------------------------------------------------------------------
// Host: the run
// ---------------------------------------------------------------------------------------------

struct Variant {
  const char* name;  // "lut" (the numba kernel's design) or "mma"
  bool (*plan)(const Shape&, int B, const Request&, const DeviceInfo&, Plan&, std::string& why);
  std::vector<Request> (*candidates)(const Shape&, int B);
  bool (*keep)(const Plan&);  // candidates worth timing
};

struct Scheme {
  const char* kernel;  // JSON "kernel"
  const char* file;    // source file, for the table
  std::vector<int> Ks;
};

struct Options {
  std::vector<std::pair<int, int>> shapes;  // (in, out)
  std::vector<int> batches{1};
  std::vector<int> Ks;
  int iters = 30, launches = 20;
  std::string json, variant = "all";
  Request force;
  bool tune = true, sweep = false;
};

inline void usage(const char* prog, const Scheme& sc) {
  printf(
      "usage: %s [--in N --out M] [--batch B[,B...]] [--iters N] [--launches L] [--json PATH]\n"
      "          [--variant lut|mma|dual|all] [--no-tune] [--sweep] [--warps W] [--ksplit S] [--rb R]%s\n"
      "  default shapes (in x out): 4096x4096 (the seed's table), 3072x768, 11008x4096, 4096x11008,\n"
      "  4096x14336, 14336x4096, 8192x28672, 16384x53248; batch 1; every plan candidate is checked and\n"
      "  timed briefly and the fastest timed in full (--no-tune: the heuristic plan only; --sweep:\n"
      "  print every candidate's time).\n",
      prog, sc.Ks.size() > 1 ? " [--K 64|256]" : "");
}

inline std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    char* end;
    const long x = strtol(p, &end, 10);
    if (end == p) break;
    v.push_back((int)x);
    p = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') break;
  }
  return v;
}

inline Options parse(int argc, char** argv, const Scheme& sc) {
  Options o;
  o.Ks = sc.Ks;
  int in = 0, out = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) { fprintf(stderr, "%s needs a value\n", a.c_str()); exit(2); }
      return argv[++i];
    };
    if (a == "--in") in = atoi(val());
    else if (a == "--out") out = atoi(val());
    else if (a == "--batch") o.batches = parse_list(val());
    else if (a == "--iters") o.iters = atoi(val());
    else if (a == "--launches") o.launches = atoi(val());
    else if (a == "--json") o.json = val();
    else if (a == "--variant") o.variant = val();
    else if (a == "--warps") o.force.warps = atoi(val());
    else if (a == "--ksplit") o.force.ksplit = atoi(val());
    else if (a == "--rb") o.force.rb = atoi(val());
    else if (a == "--no-tune") o.tune = false;
    else if (a == "--sweep") o.sweep = true;
    else if (a == "--K" && sc.Ks.size() > 1) o.Ks = parse_list(val());
    else if (a == "-h" || a == "--help") { usage(argv[0], sc); exit(0); }
    else { fprintf(stderr, "unknown argument %s\n", a.c_str()); usage(argv[0], sc); exit(2); }
  }
  if ((in > 0) != (out > 0)) { fprintf(stderr, "--in and --out go together\n"); exit(2); }
  if (in > 0) o.shapes = {{in, out}};
  else o.shapes = {{4096, 4096}, {3072, 768}, {11008, 4096}, {4096, 11008},
                   {4096, 14336}, {14336, 4096}, {8192, 28672}, {16384, 53248}};
  for (int b : o.batches)
    if (b < 1 || b > 16) { fprintf(stderr, "batch must be 1..16, got %d\n", b); exit(2); }
  for (int k : o.Ks)
    if (std::find(sc.Ks.begin(), sc.Ks.end(), k) == sc.Ks.end()) { fprintf(stderr, "K=%d not handled here\n", k); exit(2); }
  if (o.iters < 1 || o.launches < 1) { fprintf(stderr, "--iters and --launches must be positive\n"); exit(2); }
  if (o.force.warps || o.force.ksplit || o.force.rb) o.tune = false;
  return o;
}

struct Record {
  std::string kernel, variant, scheme, plan;
  int K = 0, batch = 0, in = 0, out = 0;
  double time_ms = 0, fp16_ms = 0, gbps = 0, fp16_gbps = 0, err_cublas = 0, err_fp64 = 0, cublas_err_fp64 = 0;
  double tmin = 0, tmax = 0;
  Plan p;
  int copies = 0, launches = 0;
  bool ok = true;
  std::string note;
};

struct Timing {
  double median = 0, min = 0, max = 0;
  int launches = 0;
};

// One graph of max(launches, copies) launches cycling through the copies (so a replay's working
// set is every copy: >= 4x L2), replayed `iters` times; per-launch time of each replay, median.
template <class F>
Timing time_graph(cudaStream_t st, int copies, int launches, int iters, int warmup, F&& launch) {
  Timing t;
  t.launches = std::max(launches, copies);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  TP_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < t.launches; ++i) launch(i % copies);
  TP_CHECK(cudaStreamEndCapture(st, &graph));
  TP_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < warmup; ++i) TP_CHECK(cudaGraphLaunch(exec, st));
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) TP_CHECK(cudaEventCreate(&e));
  for (int r = 0; r < iters; ++r) {
    TP_CHECK(cudaEventRecord(ev[2 * r], st));
    TP_CHECK(cudaGraphLaunch(exec, st));
    TP_CHECK(cudaEventRecord(ev[2 * r + 1], st));
  }
  TP_CHECK(cudaStreamSynchronize(st));
  std::vector<double> ms(iters);
  for (int r = 0; r < iters; ++r) {
    float f;
    TP_CHECK(cudaEventElapsedTime(&f, ev[2 * r], ev[2 * r + 1]));
    ms[r] = f / t.launches;
  }
  for (auto& e : ev) TP_CHECK(cudaEventDestroy(e));
  TP_CHECK(cudaGraphExecDestroy(exec));
  TP_CHECK(cudaGraphDestroy(graph));
  std::sort(ms.begin(), ms.end());
  t.median = iters % 2 ? ms[iters / 2] : 0.5 * (ms[iters / 2 - 1] + ms[iters / 2]);
  t.min = ms.front();
  t.max = ms.back();
  return t;
}

inline int copies_for(size_t bytes, size_t l2) {  // trapetum.bench.copies_for
  return std::max(2, std::min(256, cdiv(4LL * (long long)l2, (long long)std::max<size_t>(bytes, 1))));
}

// max |y - ref| / max |ref| over the given entries (all if idx is empty); inf on any non-finite y.
inline double max_rel(const std::vector<double>& y, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) return INFINITY;
    num = std::max(num, std::fabs(y[i] - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return num / std::max(den, 1e-30);
}

struct Problem {  // one shape's data, host and device
  Shape s;
  int Bmax;
  std::vector<uint8_t> packed;  // natural layout
  std::vector<__half> C, x;     // (out x K), (Bmax x in)
  std::vector<int> sample;      // rows checked against float64
  std::vector<double> ref64;    // [Bmax][sample] float64 reference
  // device
  uint8_t* d_packed = nullptr;
  __half *d_C = nullptr, *d_x = nullptr, *d_y = nullptr, *d_yref = nullptr;
  std::vector<uint4*> d_tiled, d_cbt;
  std::vector<__half*> d_W;
  float* d_ws = nullptr;
  size_t ws_floats = 0;
  unsigned* d_counters = nullptr;

  Problem(const Shape& sh, int bmax) : s(sh), Bmax(bmax) {}
};

inline void generate(Problem& P) {
  const Shape& s = P.s;
  std::mt19937 rng(0);
  // Codes: uniform in [0, K) for K a power of two, so each byte is random bits (masked for K=64).
  P.packed.resize(s.code_bytes());
  const uint32_t mask = s.K == 64 ? 0x3F3F3F3Fu : 0xFFFFFFFFu;
  for (size_t i = 0; i < P.packed.size(); i += 4) {
    const uint32_t r = (uint32_t)rng() & mask;
    memcpy(&P.packed[i], &r, 4);  // in_bytes is a multiple of 16
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  P.C.resize((size_t)s.n_out * s.K);
  for (auto& c : P.C) c = __float2half(nd(rng));
  P.x.resize((size_t)P.Bmax * s.n_in);
  for (auto& v : P.x) v = __float2half(nd(rng));
  // float64 reference on a sample of rows: both ends, row-block edges, and an even spread.
  std::set<int> rows{0, 1, 31, 32, 33, s.n_out - 2, s.n_out - 1};
  for (int i = 0; i < 57; ++i) rows.insert((int)((long long)i * (s.n_out - 1) / 56));
  P.sample.clear();
  for (int r : rows)
    if (r >= 0 && r < s.n_out) P.sample.push_back(r);
  P.ref64.assign((size_t)P.Bmax * P.sample.size(), 0.0);
  std::vector<double> xd(P.x.size());
  for (size_t i = 0; i < xd.size(); ++i) xd[i] = __half2float(P.x[i]);
  for (size_t k = 0; k < P.sample.size(); ++k) {
    const int o = P.sample[k];
    const uint8_t* row = &P.packed[(size_t)o * s.in_bytes];
    for (int b = 0; b < P.Bmax; ++b) {
      double acc = 0;
      const double* xb = &xd[(size_t)b * s.n_in];
      for (int i = 0; i < s.n_in; ++i) {
        const int q = s.bits == 4 ? (row[i >> 1] >> ((i & 1) * 4)) & 15 : row[i];
        acc += xb[i] * (double)__half2float(P.C[(size_t)o * s.K + q]);
      }
      P.ref64[(size_t)b * P.sample.size() + k] = acc;
    }
  }
}

// trapetum.codebook.tile: codes [rb][chunk][lane][16], codebooks [rb][k][lane], zero-padded rows.
inline void tile(const Problem& P, std::vector<uint8_t>& tiled, std::vector<__half>& cbt) {
  const Shape& s = P.s;
  tiled.assign((size_t)s.rbs * kRowBlock * s.in_bytes, 0);
  cbt.assign((size_t)s.rbs * s.K * kRowBlock, __float2half(0.f));
  for (int o = 0; o < s.n_out; ++o) {
    const int rb = o / kRowBlock, lane = o % kRowBlock;
    for (int j = 0; j < s.nchunks; ++j)
      memcpy(&tiled[(((size_t)rb * s.nchunks + j) * kRowBlock + lane) * kChunk],
             &P.packed[(size_t)o * s.in_bytes + (size_t)j * kChunk], kChunk);
    for (int k = 0; k < s.K; ++k) cbt[((size_t)rb * s.K + k) * kRowBlock + lane] = P.C[(size_t)o * s.K + k];
  }
}

class Runner {
 public:
  Runner(const Scheme& sc, const std::vector<Variant>& vs, const Options& o) : sc_(sc), vs_(vs), o_(o) {
    int dev = 0;
    TP_CHECK(cudaGetDevice(&dev));
    TP_CHECK(cudaGetDeviceProperties(&d_.prop, dev));
    d_.sms = d_.prop.multiProcessorCount;
    d_.l2 = d_.prop.l2CacheSize;
    d_.smem_optin = d_.prop.sharedMemPerBlockOptin;
    TP_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking));
    TP_CUBLAS(cublasCreate(&blas_));
    TP_CUBLAS(cublasSetStream(blas_, st_));
    // A workspace of our own: cuBLAS then allocates nothing while a graph is being captured.
    TP_CHECK(cudaMalloc(&blas_ws_, 32u << 20));
    TP_CUBLAS(cublasSetWorkspace(blas_, blas_ws_, 32u << 20));
    int rt = 0, drv = 0;
    TP_CHECK(cudaRuntimeGetVersion(&rt));
    TP_CHECK(cudaDriverGetVersion(&drv));
    printf("# %s, sm_%d%d, %d SMs, L2 %.0f MiB, shared/block opt-in %zu KiB, runtime %d, driver %d\n",
           d_.prop.name, d_.prop.major, d_.prop.minor, d_.sms, d_.l2 / 1048576.0, d_.smem_optin / 1024, rt, drv);
    rt_ = rt;
    drv_ = drv;
  }
  ~Runner() {
    cublasDestroy(blas_);
    cudaFree(blas_ws_);
    cudaStreamDestroy(st_);
  }

  int run() {
    for (int K : o_.Ks)
      for (auto [in, out] : o_.shapes) run_shape(Shape(in, out, K));
    print_table();
    if (!o_.json.empty()) write_json();
    if (failures_) printf("\n%d correctness check(s) FAILED\n", failures_);
    return failures_ ? 1 : 0;
  }

 private:
  const Scheme& sc_;
  const std::vector<Variant>& vs_;
  const Options& o_;
  DeviceInfo d_;
  cudaStream_t st_;
  cublasHandle_t blas_;
  void* blas_ws_ = nullptr;
  int rt_ = 0, drv_ = 0;
  std::vector<Record> recs_, sweep_;
  int failures_ = 0;

  std::string scheme_name(int K) const {
    return K == 16 ? "4-bit K=16" : "uint8 K=" + std::to_string(K);
  }

  void upload(Problem& P) {
    const Shape& s = P.s;
    std::vector<uint8_t> tiled;
    std::vector<__half> cbt;
    tile(P, tiled, cbt);
    TP_CHECK(cudaMalloc(&P.d_packed, P.packed.size()));
    TP_CHECK(cudaMemcpy(P.d_packed, P.packed.data(), P.packed.size(), cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_C, P.C.size() * 2));
    TP_CHECK(cudaMemcpy(P.d_C, P.C.data(), P.C.size() * 2, cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_x, P.x.size() * 2));
    TP_CHECK(cudaMemcpy(P.d_x, P.x.data(), P.x.size() * 2, cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_y, (size_t)P.Bmax * s.n_out * 2));
    TP_CHECK(cudaMalloc(&P.d_yref, (size_t)P.Bmax * s.n_out * 2));
    TP_CHECK(cudaMalloc(&P.d_counters, (size_t)s.rbs * sizeof(unsigned)));
    TP_CHECK(cudaMemset(P.d_counters, 0, (size_t)s.rbs * sizeof(unsigned)));
    // Rotation copies of what one launch reads: together at least 4x the L2.
    const int nc = copies_for(s.code_bytes() + s.cb_bytes(), d_.l2);
    for (int c = 0; c < nc; ++c) {
      uint4 *t, *cb;
      TP_CHECK(cudaMalloc(&t, tiled.size()));
      TP_CHECK(cudaMalloc(&cb, cbt.size() * 2));
      if (c == 0) {
        TP_CHECK(cudaMemcpy(t, tiled.data(), tiled.size(), cudaMemcpyHostToDevice));
        TP_CHECK(cudaMemcpy(cb, cbt.data(), cbt.size() * 2, cudaMemcpyHostToDevice));
      } else {
        TP_CHECK(cudaMemcpy(t, P.d_tiled[0], tiled.size(), cudaMemcpyDeviceToDevice));
        TP_CHECK(cudaMemcpy(cb, P.d_cbt[0], cbt.size() * 2, cudaMemcpyDeviceToDevice));
      }
      P.d_tiled.push_back(t);
      P.d_cbt.push_back(cb);
    }
    // fp16 W for cuBLAS, dequantized on the device from the natural layout (so the reference does
    // not share the tiling with the kernels), and its rotation copies.
    const size_t wbytes = (size_t)s.n_out * s.n_in * 2;
    const int nw = copies_for(wbytes, d_.l2);
    for (int c = 0; c < nw; ++c) {
      __half* w;
      TP_CHECK(cudaMalloc(&w, wbytes));
      if (c == 0) {
        const int blocks = 8 * d_.sms;
        if (s.K == 16) dequant_kernel<16><<<blocks, 256, 0, st_>>>(P.d_packed, P.d_C, w, s.n_out, s.n_in);
        else if (s.K == 64) dequant_kernel<64><<<blocks, 256, 0, st_>>>(P.d_packed, P.d_C, w, s.n_out, s.n_in);
        else dequant_kernel<256><<<blocks, 256, 0, st_>>>(P.d_packed, P.d_C, w, s.n_out, s.n_in);
        TP_LAUNCHED();
        TP_CHECK(cudaStreamSynchronize(st_));
      } else {
        TP_CHECK(cudaMemcpy(w, P.d_W[0], wbytes, cudaMemcpyDeviceToDevice));
      }
      P.d_W.push_back(w);
    }
  }

  void release(Problem& P) {
    cudaFree(P.d_packed);
    cudaFree(P.d_C);
    cudaFree(P.d_x);
    cudaFree(P.d_y);
    cudaFree(P.d_yref);
    cudaFree(P.d_counters);
    cudaFree(P.d_ws);
    for (auto p : P.d_tiled) cudaFree(p);
    for (auto p : P.d_cbt) cudaFree(p);
    for (auto p : P.d_W) cudaFree(p);
    TP_CHECK(cudaGetLastError());
  }

  void cublas_gemm(const Problem& P, int B, int copy, __half* y) {
    // Row-major y (B x out) = x (B x in) @ W^T, W row-major (out x in): in cuBLAS's column-major
    // terms y^T (out x B) = W (op T of the in x out matrix) * x^T (in x B).
    const float one = 1.f, zero = 0.f;
    TP_CUBLAS(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, P.s.n_out, B, P.s.n_in, &one, P.d_W[copy],
                           CUDA_R_16F, P.s.n_in, P.d_x, CUDA_R_16F, P.s.n_in, &zero, y, CUDA_R_16F, P.s.n_out,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  void ensure_ws(Problem& P, const Plan& pl, int B) {
    const size_t need = (size_t)pl.ksplit * B * P.s.n_out;
    if (need > P.ws_floats) {
      TP_CHECK(cudaFree(P.d_ws));
      TP_CHECK(cudaMalloc(&P.d_ws, need * sizeof(float)));
      P.ws_floats = need;
    }
  }

  GemvParams params(const Problem& P, const Plan& pl, int B, int copy) const {
    GemvParams g;
    g.codes = P.d_tiled[copy];
    g.cb = P.d_cbt[copy];
    g.x = reinterpret_cast<const uint4*>(P.d_x);
    g.y = P.d_y;
    g.ws = P.d_ws;
    g.counters = P.d_counters;
    g.B = B;
    g.n_in = P.s.n_in;
    g.n_out = P.s.n_out;
    g.rbs = P.s.rbs;
    g.nchunks = P.s.nchunks;
    g.cps = pl.cps;
    return g;
  }

  void launch(const Problem& P, const Plan& pl, int B, int copy) {
    pl.fn<<<dim3(pl.gridx, pl.ksplit), pl.warps * 32, pl.smem, st_>>>(params(P, pl, B, copy));
    TP_LAUNCHED();
  }

  std::vector<double> fetch(const __half* d, size_t n) {
    std::vector<__half> h(n);
    TP_CHECK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = __half2float(h[i]);
    return v;
  }

  std::vector<double> sampled(const Problem& P, const std::vector<double>& y, int B) {
    std::vector<double> v;
    for (int b = 0; b < B; ++b)
      for (int r : P.sample) v.push_back(y[(size_t)b * P.s.n_out + r]);
    return v;
  }

  std::vector<double> ref64(const Problem& P, int B) {
    return std::vector<double>(P.ref64.begin(), P.ref64.begin() + (size_t)B * P.sample.size());
  }

  // Poisons y (0xFFFF is an fp16 NaN) and the workspace, runs once on `copy`, and compares with
  // cuBLAS (every output) and float64 (the sampled rows). Returns false on NaN or error > tolerance.
  bool check(Problem& P, const Plan& pl, int B, int copy, const std::vector<double>& yref, double& e_cublas,
             double& e_fp64) {
    const size_t n = (size_t)B * P.s.n_out;
    ensure_ws(P, pl, B);
    TP_CHECK(cudaMemsetAsync(P.d_y, 0xFF, n * 2, st_));
    TP_CHECK(cudaMemsetAsync(P.d_ws, 0xFF, P.ws_floats * sizeof(float), st_));
    launch(P, pl, B, copy);
    TP_CHECK(cudaStreamSynchronize(st_));
    const std::vector<double> y = fetch(P.d_y, n);
    e_cublas = max_rel(y, yref);
    e_fp64 = max_rel(sampled(P, y, B), ref64(P, B));
    return e_cublas <= kTolerance && e_fp64 <= kTolerance;
  }

  void run_shape(const Shape& s) {
    const int need = s.bits == 4 ? 32 : 16;
    if (s.n_in % need || s.n_in <= 0 || s.n_out <= 0) {
      fprintf(stderr, "in=%d: %s needs in to be a positive multiple of %d\n", s.n_in, scheme_name(s.K).c_str(), need);
      ++failures_;
      return;
    }
    const int bmax = *std::max_element(o_.batches.begin(), o_.batches.end());
    Problem P(s, bmax);
    generate(P);
    upload(P);
    const int copies = (int)P.d_tiled.size(), wcopies = (int)P.d_W.size();
    for (int B : o_.batches) {
      // cuBLAS reference and baseline.
      const size_t n = (size_t)B * s.n_out;
      TP_CHECK(cudaMemsetAsync(P.d_yref, 0xFF, n * 2, st_));
      cublas_gemm(P, B, 0, P.d_yref);
      TP_CHECK(cudaStreamSynchronize(st_));
      const std::vector<double> yref = fetch(P.d_yref, n);
      const double cublas_err = max_rel(sampled(P, yref, B), ref64(P, B));
      const bool cublas_ok = cublas_err <= kTolerance;
      if (!cublas_ok) {
        printf("FAIL cuBLAS %dx%d B=%d: vs float64 %.3g\n", s.n_in, s.n_out, B, cublas_err);
        ++failures_;
      }
      const Timing tf = time_graph(st_, wcopies, o_.launches, o_.iters, 3,
                                   [&](int c) { cublas_gemm(P, B, c, P.d_y); });
      const double fp16_bytes = (double)s.n_out * s.n_in * 2 + 2.0 * B * (s.n_in + s.n_out);
      {
        Record r;
        r.kernel = "cuBLAS fp16";
        r.variant = "";
        r.scheme = "dense fp16";
        r.K = 0;
        r.batch = B;
        r.in = s.n_in;
        r.out = s.n_out;
        r.time_ms = r.fp16_ms = tf.median;
        r.gbps = r.fp16_gbps = fp16_bytes / (tf.median * 1e-3) / 1e9;
        r.tmin = tf.min;
        r.tmax = tf.max;
        r.cublas_err_fp64 = cublas_err;
        r.copies = wcopies;
        r.launches = tf.launches;
        r.ok = cublas_ok;
        recs_.push_back(r);
      }
      printf("# %s %dx%d B=%d: cuBLAS fp16 %.4f ms (%.0f GB/s), vs float64 %.2e; %d code copies, %d W copies\n",
             scheme_name(s.K).c_str(), s.n_in, s.n_out, B, tf.median, fp16_bytes / (tf.median * 1e-3) / 1e9,
             cublas_err, copies, wcopies);
      for (const Variant& v : vs_)
        if (o_.variant == "all" || o_.variant == v.name) run_variant(P, v, B, yref, tf.median, cublas_err);
    }
    release(P);
  }

  void run_variant(Problem& P, const Variant& v, int B, const std::vector<double>& yref, double fp16_ms,
                   double cublas_err) {
    const Shape& s = P.s;
    const int copies = (int)P.d_tiled.size();
    Record r;
    r.kernel = sc_.kernel;
    r.variant = v.name;
    r.scheme = scheme_name(s.K);
    r.K = s.K;
    r.batch = B;
    r.in = s.n_in;
    r.out = s.n_out;
    r.fp16_ms = fp16_ms;
    r.cublas_err_fp64 = cublas_err;
    r.copies = copies;
    const double bytes = (double)s.code_bytes() + s.cb_bytes() + 2.0 * B * (s.n_in + s.n_out);

    // Plans: the forced one, the heuristic alone, or every candidate (each checked, briefly timed).
    std::vector<Plan> plans;
    std::string why;
    std::set<std::string> seen;
    auto add = [&](const Request& rq, bool filter) {
      Plan pl;
      if (!v.plan(s, B, rq, d_, pl, why)) return;
      if (filter && !v.keep(pl)) return;
      if (seen.insert(pl.key()).second) plans.push_back(pl);
    };
    if (!o_.tune) {
      add(o_.force, false);
    } else {
      add(Request{}, false);
      for (const Request& rq : v.candidates(s, B)) add(rq, true);
    }
    if (plans.empty()) {
      printf("  %-5s %s %dx%d B=%d: no plan (%s)\n", v.name, r.scheme.c_str(), s.n_in, s.n_out, B, why.c_str());
      r.ok = false;
      r.note = "no plan: " + why;
      ++failures_;
      recs_.push_back(r);
      return;
    }
    Plan best;
    double best_ms = INFINITY;
    bool all_ok = true;
    for (const Plan& pl : plans) {
      double ec, e64;
      const bool ok = check(P, pl, B, 0, yref, ec, e64);
      if (!ok) {
        printf("FAIL %s %s %s %dx%d B=%d [%s]: vs cuBLAS %.3g, vs float64 %.3g\n", sc_.kernel, v.name,
               r.scheme.c_str(), s.n_in, s.n_out, B, pl.key().c_str(), ec, e64);
        all_ok = false;
        ++failures_;
        continue;
      }
      if (plans.size() == 1) { best = pl; break; }
      ensure_ws(P, pl, B);
      const Timing t = time_graph(st_, copies, 10, 5, 1, [&](int c) { launch(P, pl, B, c); });
      if (o_.sweep) {
        printf("    sweep %-5s %dx%d B=%d [%s] cps %d, %d blocks/SM, %zu B smem: %.4f ms\n", v.name, s.n_in, s.n_out,
               B, pl.key().c_str(), pl.cps, pl.occupancy, pl.smem, t.median);
        Record w = r;
        w.p = pl;
        w.plan = pl.key();
        w.time_ms = t.median;
        w.err_cublas = ec;
        w.err_fp64 = e64;
        w.launches = t.launches;
        sweep_.push_back(w);
      }
      if (t.median < best_ms) { best_ms = t.median; best = pl; }
    }
    if (!best.fn) {
      r.ok = false;
      r.note = "every plan failed its check";
      recs_.push_back(r);
      return;
    }
    ensure_ws(P, best, B);
    const Timing t = time_graph(st_, copies, o_.launches, o_.iters, 3, [&](int c) { launch(P, best, B, c); });
    // Check again after the timing, on another copy: a race shows up as a changed result.
    double ec, e64;
    const bool ok = check(P, best, B, copies - 1, yref, ec, e64);
    if (!ok) {
      printf("FAIL %s %s after timing [%s]: vs cuBLAS %.3g, vs float64 %.3g\n", sc_.kernel, v.name,
             best.key().c_str(), ec, e64);
      ++failures_;
    }
    r.ok = ok && all_ok;
    r.p = best;
    r.plan = best.key();
    r.time_ms = t.median;
    r.tmin = t.min;
    r.tmax = t.max;
    r.launches = t.launches;
    r.gbps = bytes / (t.median * 1e-3) / 1e9;
    r.err_cublas = ec;
    r.err_fp64 = e64;
    recs_.push_back(r);
    printf("  %-5s %s %dx%d B=%d [%s, cps %d, %d blocks/SM, %zu B smem, %d plans]: %.4f ms, %.2fx cuBLAS, %.0f GB/s, "
           "err vs cuBLAS %.2e, vs float64 %.2e%s\n",
           v.name, r.scheme.c_str(), s.n_in, s.n_out, B, r.plan.c_str(), best.cps, best.occupancy, best.smem,
           plans.size(), t.median, fp16_ms / t.median, r.gbps, ec, e64, r.ok ? "" : "  FAIL");
  }

  void print_table() {
    printf("\nMax rel. err = max|y - ref| / max|ref| over all outputs, ref = cuBLAS fp16 GEMM (fp32 accumulate)\n"
           "on the same codes (float64 on sampled rows is in the JSON). Times: %s.\n\n",
           kMethod);
    printf("| Kernel | Scheme | in x out | batch | Latency (ms) | cuBLAS fp16 (ms) | vs cuBLAS | GB/s | Max rel. err |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const Record& r : recs_) {
      const bool base = r.variant.empty();
      std::string name = base ? r.kernel : std::string(sc_.file) + " " + r.variant + " (" + r.plan + ")";
      char err[32];
      if (base) snprintf(err, sizeof err, "-");
      else if (!r.ok) snprintf(err, sizeof err, "FAIL %.1e", r.err_cublas);
      else snprintf(err, sizeof err, "%.1e", r.err_cublas);
      if (!base && r.time_ms == 0) {
        printf("| %s | %s | %dx%d | %d | - | %.4f | - | - | %s |\n", name.c_str(), r.scheme.c_str(), r.in, r.out,
               r.batch, r.fp16_ms, r.note.c_str());
        continue;
      }
      printf("| %s | %s | %dx%d | %d | %.4f | %.4f | %.2fx | %.0f | %s |\n", name.c_str(), r.scheme.c_str(), r.in,
             r.out, r.batch, r.time_ms, r.fp16_ms, r.fp16_ms / r.time_ms, r.gbps, err);
    }
  }

  static void json_record(FILE* f, const Record& r, bool last) {
    fprintf(f,
            "    {\"kernel\": \"%s\", \"variant\": \"%s\", \"scheme\": \"%s\", \"K\": %d, \"batch\": %d, "
            "\"in_features\": %d, \"out_features\": %d, \"time_ms\": %.6g, \"fp16_ms\": %.6g, \"speedup\": %.6g, "
            "\"gbps\": %.6g, \"max_rel_err\": %.6g, \"max_rel_err_fp64\": %.6g, \"cublas_rel_err_fp64\": %.6g, "
            "\"passed\": %s, \"method\": \"%s\", \"time_ms_min\": %.6g, \"time_ms_max\": %.6g, "
            "\"rb\": %d, \"warps\": %d, \"ksplit\": %d, \"cps\": %d, \"grid\": [%d, %d], \"smem_bytes\": %zu, "
            "\"blocks_per_sm\": %d, \"copies\": %d, \"launches_per_graph\": %d}%s\n",
            r.kernel.c_str(), r.variant.c_str(), r.scheme.c_str(), r.K, r.batch, r.in, r.out, r.time_ms, r.fp16_ms,
            r.time_ms > 0 ? r.fp16_ms / r.time_ms : 0.0, r.gbps, r.err_cublas, r.err_fp64, r.cublas_err_fp64,
            r.ok ? "true" : "false", kMethod, r.tmin, r.tmax, r.p.rb, r.p.warps, r.p.ksplit, r.p.cps, r.p.gridx,
            r.p.ksplit, r.p.smem, r.p.occupancy, r.copies, r.launches, last ? "" : ",");
  }

  void write_json() {
    FILE* f = fopen(o_.json.c_str(), "w");
    if (!f) { fprintf(stderr, "cannot write %s\n", o_.json.c_str()); exit(2); }
    fprintf(f, "{\n  \"device\": {\"name\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, \"l2_bytes\": %zu, "
               "\"runtime\": %d, \"driver\": %d, \"nvcc\": \"%d.%d\"},\n",
            d_.prop.name, d_.prop.major, d_.prop.minor, d_.sms, d_.l2, rt_, drv_, __CUDACC_VER_MAJOR__,
            __CUDACC_VER_MINOR__);
    std::vector<const Record*> rs;
    for (const Record& r : recs_)
      if (!r.variant.empty()) rs.push_back(&r);  // the baseline lives in each record's fp16_ms
    fprintf(f, "  \"records\": [\n");
    for (size_t i = 0; i < rs.size(); ++i) json_record(f, *rs[i], i + 1 == rs.size());
    fprintf(f, "  ],\n  \"sweep\": [\n");
    for (size_t i = 0; i < sweep_.size(); ++i) json_record(f, sweep_[i], i + 1 == sweep_.size());
    fprintf(f, "  ]\n}\n");
    fclose(f);
    printf("wrote %s\n", o_.json.c_str());
  }
};

}  // namespace tp
