// Fused GEMV for additive (AQLM-style) 2-bit codes: M = 2 codebooks of K = 256 entries of D = 8
// fp16 values, groups of 8 consecutive inputs, one fp16 scale a row:
//   W[o, 8g:8g+8] = scale[o] * (cb[0][codes[o][g][0]] + cb[1][codes[o][g][1]])
//   y[b, o] = sum_i x[b, i] W[o, i]      (fp16 x, codebooks, scales and y; fp32 accumulation)
// Natural layout (trapetum.additive, the aqlm package's 2x8): codes uint8 (out, in/8, 2),
// codebooks fp16 (2, 256, 8), scales fp16 (out).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 kernels/gemv_additive_2bit.cu -lcublas -o gemv_add && ./gemv_add
//   ./gemv_add --json add2.json --sweep     # every plan's time too (trapetum.bench.run_cuda_cpp
//                                            # passes --json, program="gemv_additive_2bit")
//
// Kernel layout of the codes (built here by tile_codes, the same tiling as trapetum.codebook.tile
// with 2 bytes a group): rows in row-blocks of 32 (out padded with zero codes), each row's code
// bytes (2 a group, m = 0 first) in 16-byte chunks of 8 groups (64 inputs),
//   tiled[((rb * nchunks + j) * 32 + lane) * 16 + t] = codes[rb*32 + lane][8j + t/2][t%2],
// so a warp's load of chunk j of a row-block is 512 contiguous bytes.
//
// The kernel (seed 004: "a per-group lookup table in shared memory, then read only the codes").
// Grid (ceil(rbs / (W*RPW)), ceil(nslices / spb)), W warps. A block owns W*RPW row-blocks
// (warp w: row-blocks w, w + W, ...; lane l: row 32 rb + l) and spb consecutive K-slices of CPS
// chunks (G = 8 CPS groups). For each slice:
//   1. every lane issues its RPW*CPS 16-byte code loads (all of them, into registers) first;
//   2. the block builds LUT[b][g][m*256 + k] = dot(cb[m][k], x[b][8g:8g+8]) in fp32 for the
//      slice's G groups ON THE TENSOR CORES: LUT (512 x G) = CB (512 x 8) * X (8 x G), one
//      mma.m16n8k8 (fp16 in, fp32 accumulate: products of fp16 are exact in fp32) makes 16
//      entries x 8 groups; 4G mmas a slice, 16 fp32 stores a group and warp (conflict-free: a
//      (b,g) table is 516 words, 4 of padding, so the 4 groups of a D fragment sit 8 banks apart);
//   3. __syncthreads, then each group of a row costs two lookups and two FADDs: the code byte is
//      one PRMT, the address one LEA (byte*4 + chunk base), the (b, g, m) offset is an immediate
//      of the LDS (CPS, RPW, NB compile-time: every loop is unrolled).
// The codes' latency hides behind the table build; with spb > 1 slices a block, the next slice's
// codes are loaded before the current slice's lookups (<= 4 chunks a lane; otherwise right after
// them). The table is fp32 by default, fp16 as a plan option (see gemv_add2). SASS (ptxas 13.0,
// batch 1, 512 rows, 4 chunks): the lookup loop is 502 instructions for 128 codes, 3.9 a code
// (PRMT + LEA + LDS [R+imm] + FADD), no spills. The scale multiplies once at the end. Slices
// of one block column are reduced through an fp32 workspace by the last block to finish
// (atomic counter, reset by that block, so the launch replays in a CUDA graph), in slice order.
//
// Cost model (H100, 132 SMs, 4096 x 14336, batch 1): 14.7 MB of codes (~5 us at 2.9 TB/s);
// 14.7 M lookups = 459 K warp-lookups of a 256-entry fp32 table at ~3.15 shared wavefronts each
// (expected max distinct words a bank for 32 random codes, simulated) = 1.45 M wavefronts =
// 11 K clocks an SM = 5.5 us of the shared pipe, plus the table stores (16 wavefronts a group
// and block: 16/(0.2 rows) of the lookups, 3% at 512 rows a block).
#include <type_traits>

#include "harness.cuh"

using namespace tp;

namespace add2 {

constexpr int kM = 2, kK = 256, kD = 8;
constexpr int kGS = kM * kK + 4;  // words of one (batch, group) table: 2 x 256 fp32 + 4 padding
constexpr int kGroupsPerChunk = 8;  // 16 bytes of codes, 64 inputs

struct Params {
  const uint4* codes;     // tiled (see top)
  const __half* cb;       // (2, 256, 8)
  const __half* scales;   // (out)
  const __half* x;        // [B][n_in]
  __half* y;              // [B][n_out]
  float* ws;              // [grid.y][B][n_out] partial sums (unscaled)
  unsigned* counters;     // one per block column, zero between launches
  int B, n_in, n_out, rbs, nchunks, nslices, spb;
};
using Fn = void (*)(Params);

// D (16x8 f32) = A (16x8 f16, row) * B (8x8 f16, col) (PTX ISA "mma.m16n8k8", .f16 inputs):
// lane (gid = lane/4, tig = lane%4) holds A[gid][2tig..+1] in a0, A[gid+8][2tig..+1] in a1,
// B[2tig..+1][gid] in b0, and gets D[gid][2tig..+1] in d0, d1 and D[gid+8][2tig..+1] in d2, d3.
__device__ __forceinline__ void mma_1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%7, %7, %7, %7};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0), "f"(0.f));
}

// H: the table in fp16 instead of fp32 (half the shared memory and stores, 2.78 instead of 3.15
// wavefronts a warp's lookups: 4 words a bank instead of 8, so more lanes share a word). Entries
// round to 2^-11 relative; summed over 2 in/8 random roundings that is ~1e-4 of max|y|, but an
// entry above 65504 (|x| in the thousands) overflows: fp32 is the default, fp16 a plan option.
template <int NB, int W, int RPW, int CPS, bool H>
__global__ void __launch_bounds__(W * 32) gemv_add2(Params p) {
  using T = typename std::conditional<H, __half, float>::type;
  constexpr int G = CPS * kGroupsPerChunk, NL = RPW * CPS, MT = (kM * kK / 16) / W, NT = NB * G / 8;
  static_assert((kM * kK / 16) % W == 0, "M-tiles split evenly over the warps");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* lut = reinterpret_cast<T*>(smem_raw);  // [NB][G][kGS]
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  const int rb0 = blockIdx.x * (W * RPW) + warp;  // row-block r of this warp: rb0 + r * W
  const int s0 = blockIdx.y * p.spb, s1 = min(s0 + p.spb, p.nslices);

  // DB: with few codes a lane (<= 4 chunks), the next slice's codes are loaded into a second
  // set of registers before the current slice is used, so they fly during the lookups too.
  constexpr bool DB = NL <= 4;
  uint4 cur[NL], nxt[DB ? NL : 1];
  auto load = [&](uint4 (&dst)[NL], int s) {
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int c = 0; c < CPS; ++c) {
        const int rb = rb0 + r * W, j = s * CPS + c;
        dst[r * CPS + c] = (rb < p.rbs && j < p.nchunks)
                               ? ld_stream(p.codes + ((size_t)rb * p.nchunks + j) * 32 + lane)
                               : make_uint4(0, 0, 0, 0);
      }
  };
  load(cur, s0);  // codes first: everything below runs while they fly

  // A fragments (codebook entries e = m*256 + k, M-tile mt = warp + i*W), the same every slice.
  uint32_t a[MT][2];
  const uint32_t* cb32 = reinterpret_cast<const uint32_t*>(p.cb);  // entry e, dims 2t, 2t+1: cb32[e*4 + t]
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int e = (warp + i * W) * 16 + gid;
    a[i][0] = __ldg(cb32 + e * 4 + tig);
    a[i][1] = __ldg(cb32 + (e + 8) * 4 + tig);
  }

  float acc[RPW][NB];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[r][b] = 0.f;

  const int ngroups = p.n_in / kD;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(p.x);
  for (int s = s0; s < s1; ++s) {
    if (s > s0) __syncthreads();  // every warp is done reading the previous slice's table
    // Table build: N-tile nt = columns q = nt*8 .. nt*8+7, column q = (batch q / G, group q % G).
    {
      uint32_t bx[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int q = nt * 8 + gid, b = q / G, g = s * G + q % G;
        bx[nt] = (b < p.B && g < ngroups) ? __ldg(x32 + ((size_t)b * p.n_in + g * kD) / 2 + tig) : 0u;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          float d[4];
          mma_1688(d, a[i][0], a[i][1], bx[nt]);
          const int e = (warp + i * W) * 16 + gid, q = nt * 8 + 2 * tig;
          lut[q * kGS + e] = T(d[0]);
          lut[(q + 1) * kGS + e] = T(d[1]);
          lut[q * kGS + e + 8] = T(d[2]);
          lut[(q + 1) * kGS + e + 8] = T(d[3]);
        }
    }
    __syncthreads();
    if constexpr (DB) {
      if (s + 1 < s1) load(nxt, s + 1);
    }
    // Stream: chunk c of row r, word w holds groups 2w, 2w+1 of the chunk: bytes (m0, m1, m0, m1).
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int c = 0; c < CPS; ++c)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const uint32_t cw = word(cur[r * CPS + c], w);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t k0 = __byte_perm(cw, 0u, 0x4440u | (2 * h));
            const uint32_t k1 = __byte_perm(cw, 0u, 0x4440u | (2 * h + 1));
            const int g = c * kGroupsPerChunk + 2 * w + h;
#pragma unroll
            for (int b = 0; b < NB; ++b) {
              const T* t = lut + (b * G + g) * kGS;  // compile-time offset
              acc[r][b] += float(t[k0]) + float(t[kK + k1]);
            }
          }
        }
    if constexpr (DB) {
#pragma unroll
      for (int i = 0; i < NL; ++i) cur[i] = nxt[i];
    } else if (s + 1 < s1) {
      load(cur, s + 1);  // flies during the barrier and the next table build
    }
  }

  // Finish: rows directly if one K-slice column, else partials, and the last block sums them.
  const int nsplit = gridDim.y, split = blockIdx.y;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = (rb0 + r * W) * 32 + lane;
    if (row < p.n_out) {
      const float sc = __half2float(p.scales[row]);
#pragma unroll
      for (int b = 0; b < NB; ++b)
        if (b < p.B) {
          if (nsplit == 1) p.y[(size_t)b * p.n_out + row] = __float2half_rn(acc[r][b] * sc);
          else p.ws[((size_t)split * p.B + b) * p.n_out + row] = acc[r][b];
        }
    }
  }
  if (nsplit == 1) return;
  __threadfence();  // this thread's partials are visible device-wide before the block counts in
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&p.counters[blockIdx.x], 1u) == (unsigned)(nsplit - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = (rb0 + r * W) * 32 + lane;
    if (row < p.n_out) {
      const float sc = __half2float(p.scales[row]);
      for (int b = 0; b < p.B; ++b) {
        float sum = 0.f;
#pragma unroll 8
        for (int sp = 0; sp < nsplit; ++sp) sum += __ldcg(p.ws + ((size_t)sp * p.B + b) * p.n_out + row);
        p.y[(size_t)b * p.n_out + row] = __float2half_rn(sum * sc);
      }
    }
  }
  if (tid == 0) p.counters[blockIdx.x] = 0;
}

// Reference dequantizer: natural layout -> fp16 W (out x in), one group (8 values) a thread:
// W = fp16(scale * (cb0 + cb1)) computed in fp32.
__global__ void dequant_additive(const uint8_t* __restrict__ codes, const __half* __restrict__ cb,
                                 const __half* __restrict__ scales, __half* __restrict__ W, int n_out, int n_in) {
  const int ng = n_in / kD;
  const size_t n = (size_t)n_out * ng;
  for (size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (size_t)gridDim.x * blockDim.x) {
    const int o = (int)(t / ng);
    const int c0 = codes[2 * t], c1 = codes[2 * t + 1];
    const float sc = __half2float(scales[o]);
    __align__(16) __half v[kD];
#pragma unroll
    for (int d = 0; d < kD; ++d)
      v[d] = __float2half_rn(sc * (__half2float(cb[c0 * kD + d]) + __half2float(cb[(kK + c1) * kD + d])));
    *reinterpret_cast<uint4*>(W + t * kD) = *reinterpret_cast<const uint4*>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Instantiations: (NB, W, RPW, CPS). NB is the compiled batch bound (run-time batch <= NB).
// ---------------------------------------------------------------------------------------------
struct Config {
  int nb, w, rpw, cps;
  bool h;  // fp16 table
  Fn fn;
};

#define ADD2_CFG(NB, W, RPW, CPS) Config{NB, W, RPW, CPS, false, gemv_add2<NB, W, RPW, CPS, false>}
#define ADD2_CFG16(NB, W, RPW, CPS) Config{NB, W, RPW, CPS, true, gemv_add2<NB, W, RPW, CPS, true>}
static const std::vector<Config>& configs() {
  static const std::vector<Config> v = {
      // batch 1: rows a block 128..1024, G = 8..64 groups a slice
      ADD2_CFG(1, 8, 1, 2), ADD2_CFG(1, 8, 1, 4), ADD2_CFG(1, 8, 1, 8), ADD2_CFG(1, 8, 2, 2),
      ADD2_CFG(1, 8, 2, 4), ADD2_CFG(1, 8, 4, 1), ADD2_CFG(1, 8, 4, 2), ADD2_CFG(1, 4, 2, 4),
      ADD2_CFG(1, 4, 4, 2), ADD2_CFG(1, 16, 1, 4), ADD2_CFG(1, 16, 2, 2),
      // batch 1, fp16 table
      ADD2_CFG16(1, 8, 1, 4), ADD2_CFG16(1, 8, 1, 8), ADD2_CFG16(1, 8, 2, 2), ADD2_CFG16(1, 8, 2, 4),
      ADD2_CFG16(1, 8, 4, 2),
      // batch 2..8: the table grows with the batch, so shorter slices
      ADD2_CFG(2, 8, 2, 2), ADD2_CFG(2, 8, 2, 1), ADD2_CFG(2, 8, 4, 1),
      ADD2_CFG(4, 8, 2, 1), ADD2_CFG(4, 8, 4, 1), ADD2_CFG(4, 8, 1, 2),
      ADD2_CFG(8, 8, 2, 1), ADD2_CFG(8, 8, 4, 1),
      // batch 9..16: only an fp16 table of 8 groups fits (16 x 8 x 1032 B = 132 KB)
      ADD2_CFG16(16, 8, 1, 1), ADD2_CFG16(16, 8, 2, 1),
  };
  return v;
}

// harness.cuh's occupancy() for this kernel's signature: raises the dynamic shared limit to what
// the device allows beside the static shared memory (once), returns blocks an SM (0: no launch).
inline int occupancy2(Fn fn, int threads, size_t smem, const DeviceInfo& d) {
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

inline int nb_for(int B) { return B <= 1 ? 1 : B <= 2 ? 2 : B <= 4 ? 4 : B <= 8 ? 8 : B <= 16 ? 16 : 0; }

// ---------------------------------------------------------------------------------------------
// Host
// ---------------------------------------------------------------------------------------------
struct Shape2 {
  int n_in, n_out, rbs, nchunks;
  Shape2(int in, int out) : n_in(in), n_out(out) {
    rbs = cdiv(out, kRowBlock);
    nchunks = in / (kD * kGroupsPerChunk);
  }
  size_t code_bytes() const { return (size_t)n_out * (n_in / kD) * kM; }
  size_t scale_bytes() const { return (size_t)n_out * 2; }
  size_t cb_bytes() const { return (size_t)kM * kK * kD * 2; }
  double bits_per_weight() const {
    return 8.0 * (code_bytes() + scale_bytes() + cb_bytes()) / ((double)n_in * n_out);
  }
};

struct APlan {
  const Config* cfg = nullptr;
  int spb = 1, nslices = 0, gridx = 0, gridy = 0;
  size_t smem = 0;
  int occ = 0;
  int rb() const { return cfg->w * cfg->rpw; }
  std::string key() const {
    char b[96];
    snprintf(b, sizeof b, "rows%d w%d cps%d spb%d ks%d lut%d", rb() * 32, cfg->w, cfg->cps, spb, gridy, cfg->h ? 16 : 32);
    return b;
  }
};

struct AOptions {
  std::vector<std::pair<int, int>> shapes;
  std::vector<int> batches{1};
  int iters = 30, launches = 20;
  std::string json;
  int warps = 0, rows = 0, cps = 0, spb = 0, lut = 0;  // forced plan pieces (0 = any)
  bool tune = true, sweep = false;
};

static void usage(const char* prog) {
  printf(
      "usage: %s [--in N --out M] [--batch B[,B...]] [--iters N] [--launches L] [--json PATH]\n"
      "          [--no-tune] [--sweep] [--warps W] [--rows R] [--cps C] [--spb S] [--lut 32|16]\n"
      "  2-bit additive (M=2, K=256, D=8) GEMV. Default shapes (in x out): 4096x4096, 4096x11008,\n"
      "  11008x4096, 4096x14336, 14336x4096, 8192x28672, 16384x53248; batch 1 (up to 16). Every plan\n"
      "  candidate is checked against cuBLAS and timed briefly, the fastest timed in full (--no-tune:\n"
      "  the heuristic plan; --sweep: print every candidate; --warps/--rows/--cps/--spb/--lut restrict;\n"
      "  --lut 16: the fp16 table only, 32: fp32 only; default both, fp32 for --no-tune).\n",
      prog);
}

static AOptions parse_args(int argc, char** argv) {
  AOptions o;
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
    else if (a == "--warps") o.warps = atoi(val());
    else if (a == "--rows") o.rows = atoi(val());
    else if (a == "--cps") o.cps = atoi(val());
    else if (a == "--spb") o.spb = atoi(val());
    else if (a == "--lut") o.lut = atoi(val());
    else if (a == "--no-tune") o.tune = false;
    else if (a == "--sweep") o.sweep = true;
    else if (a == "-h" || a == "--help") { usage(argv[0]); exit(0); }
    else { fprintf(stderr, "unknown argument %s\n", a.c_str()); usage(argv[0]); exit(2); }
  }
  if ((in > 0) != (out > 0)) { fprintf(stderr, "--in and --out go together\n"); exit(2); }
  if (in > 0) o.shapes = {{in, out}};
  else o.shapes = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {4096, 14336}, {14336, 4096}, {8192, 28672}, {16384, 53248}};
  for (int b : o.batches)
    if (b < 1 || b > 16) { fprintf(stderr, "batch must be 1..16, got %d\n", b); exit(2); }
  if (o.iters < 1 || o.launches < 1) { fprintf(stderr, "--iters and --launches must be positive\n"); exit(2); }
  return o;
}

struct ARecord {
  std::string kernel, variant, plan, note;
  int batch = 0, in = 0, out = 0;
  double time_ms = 0, fp16_ms = 0, gbps = 0, err_cublas = 0, err_fp64 = 0, cublas_err_fp64 = 0, tmin = 0, tmax = 0;
  double bpw = 0;
  APlan p;
  int copies = 0, launches = 0;
  bool ok = true;
};

constexpr const char* kKernel = "cuda_cpp_additive";  // trapetum.report.ADDITIVE_KERNELS
constexpr const char* kScheme = "2-bit additive (M=2)";

class ARunner {
 public:
  explicit ARunner(const AOptions& o) : o_(o) {
    int dev = 0;
    TP_CHECK(cudaGetDevice(&dev));
    TP_CHECK(cudaGetDeviceProperties(&d_.prop, dev));
    d_.sms = d_.prop.multiProcessorCount;
    d_.l2 = d_.prop.l2CacheSize;
    d_.smem_optin = d_.prop.sharedMemPerBlockOptin;
    TP_CHECK(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking));
    TP_CUBLAS(cublasCreate(&blas_));
    TP_CUBLAS(cublasSetStream(blas_, st_));
    TP_CHECK(cudaMalloc(&blas_ws_, 32u << 20));
    TP_CUBLAS(cublasSetWorkspace(blas_, blas_ws_, 32u << 20));
    TP_CHECK(cudaRuntimeGetVersion(&rt_));
    TP_CHECK(cudaDriverGetVersion(&drv_));
    printf("# %s, sm_%d%d, %d SMs, L2 %.0f MiB, shared/block opt-in %zu KiB, runtime %d, driver %d\n", d_.prop.name,
           d_.prop.major, d_.prop.minor, d_.sms, d_.l2 / 1048576.0, d_.smem_optin / 1024, rt_, drv_);
  }
  ~ARunner() {
    cublasDestroy(blas_);
    cudaFree(blas_ws_);
    cudaStreamDestroy(st_);
  }

  int run() {
    for (auto [in, out] : o_.shapes) run_shape(Shape2(in, out));
    print_table();
    if (!o_.json.empty()) write_json();
    if (failures_) printf("\n%d correctness check(s) FAILED\n", failures_);
    return failures_ ? 1 : 0;
  }

 private:
  const AOptions& o_;
  DeviceInfo d_;
  cudaStream_t st_;
  cublasHandle_t blas_;
  void* blas_ws_ = nullptr;
  int rt_ = 0, drv_ = 0, failures_ = 0;
  std::vector<ARecord> recs_, sweep_;

  struct Prob {
    Shape2 s;
    int Bmax;
    std::vector<uint8_t> codes;           // natural (out, in/8, 2)
    std::vector<__half> cb, scales, x;    // (2,256,8), (out), (Bmax, in)
    std::vector<int> sample;
    std::vector<double> ref64;            // [Bmax][sample]
    uint8_t* d_codes = nullptr;
    __half *d_cb = nullptr, *d_scales = nullptr, *d_x = nullptr, *d_y = nullptr, *d_yref = nullptr;
    std::vector<uint4*> d_tiled;
    std::vector<__half*> d_W;
    float* d_ws = nullptr;
    size_t ws_floats = 0;
    unsigned* d_counters = nullptr;
    Prob(const Shape2& sh, int b) : s(sh), Bmax(b) {}
  };

  static void generate(Prob& P) {
    const Shape2& s = P.s;
    std::mt19937 rng(0);
    P.codes.resize(s.code_bytes());  // uniform codes: random bytes
    for (size_t i = 0; i < P.codes.size(); i += 4) {
      const uint32_t r = (uint32_t)rng();
      memcpy(&P.codes[i], &r, 4);  // code_bytes is a multiple of 16
    }
    std::normal_distribution<float> nd(0.f, 1.f);
    P.cb.resize((size_t)kM * kK * kD);
    for (auto& c : P.cb) c = __float2half(nd(rng));
    std::uniform_real_distribution<float> ud(0.5f, 1.5f);
    P.scales.resize(s.n_out);
    for (auto& v : P.scales) v = __float2half(ud(rng));
    P.x.resize((size_t)P.Bmax * s.n_in);
    for (auto& v : P.x) v = __float2half(nd(rng));
    std::set<int> rows{0, 1, 31, 32, 33, s.n_out - 2, s.n_out - 1};
    for (int i = 0; i < 57; ++i) rows.insert((int)((long long)i * (s.n_out - 1) / 56));
    P.sample.assign(rows.begin(), rows.end());
    P.ref64.assign((size_t)P.Bmax * P.sample.size(), 0.0);
    const int ng = s.n_in / kD;
    std::vector<double> w(s.n_in);
    for (size_t k = 0; k < P.sample.size(); ++k) {
      const int o = P.sample[k];
      const double sc = __half2float(P.scales[o]);
      for (int g = 0; g < ng; ++g) {
        const int c0 = P.codes[((size_t)o * ng + g) * 2], c1 = P.codes[((size_t)o * ng + g) * 2 + 1];
        for (int d = 0; d < kD; ++d)
          w[g * kD + d] = sc * ((double)__half2float(P.cb[c0 * kD + d]) + (double)__half2float(P.cb[(kK + c1) * kD + d]));
      }
      for (int b = 0; b < P.Bmax; ++b) {
        double acc = 0;
        for (int i = 0; i < s.n_in; ++i) acc += (double)__half2float(P.x[(size_t)b * s.n_in + i]) * w[i];
        P.ref64[(size_t)b * P.sample.size() + k] = acc;
      }
    }
  }

  // The kernel layout (see the top of the file).
  static void tile_codes(const Prob& P, std::vector<uint8_t>& tiled) {
    const Shape2& s = P.s;
    const size_t row_bytes = (size_t)(s.n_in / kD) * kM;
    tiled.assign((size_t)s.rbs * kRowBlock * row_bytes, 0);
    for (int o = 0; o < s.n_out; ++o) {
      const int rb = o / kRowBlock, lane = o % kRowBlock;
      for (int j = 0; j < s.nchunks; ++j)
        memcpy(&tiled[(((size_t)rb * s.nchunks + j) * kRowBlock + lane) * kChunk], &P.codes[o * row_bytes + (size_t)j * kChunk],
               kChunk);
    }
  }

  void upload(Prob& P) {
    const Shape2& s = P.s;
    std::vector<uint8_t> tiled;
    tile_codes(P, tiled);
    TP_CHECK(cudaMalloc(&P.d_codes, P.codes.size()));
    TP_CHECK(cudaMemcpy(P.d_codes, P.codes.data(), P.codes.size(), cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_cb, P.cb.size() * 2));
    TP_CHECK(cudaMemcpy(P.d_cb, P.cb.data(), P.cb.size() * 2, cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_scales, P.scales.size() * 2));
    TP_CHECK(cudaMemcpy(P.d_scales, P.scales.data(), P.scales.size() * 2, cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_x, P.x.size() * 2));
    TP_CHECK(cudaMemcpy(P.d_x, P.x.data(), P.x.size() * 2, cudaMemcpyHostToDevice));
    TP_CHECK(cudaMalloc(&P.d_y, (size_t)P.Bmax * s.n_out * 2));
    TP_CHECK(cudaMalloc(&P.d_yref, (size_t)P.Bmax * s.n_out * 2));
    TP_CHECK(cudaMalloc(&P.d_counters, (size_t)s.rbs * sizeof(unsigned)));
    TP_CHECK(cudaMemset(P.d_counters, 0, (size_t)s.rbs * sizeof(unsigned)));
    // Rotation copies of the codes (what a launch streams): together at least 4x the L2.
    const int nc = copies_for(tiled.size(), d_.l2);
    for (int c = 0; c < nc; ++c) {
      uint4* t;
      TP_CHECK(cudaMalloc(&t, tiled.size()));
      if (c == 0) TP_CHECK(cudaMemcpy(t, tiled.data(), tiled.size(), cudaMemcpyHostToDevice));
      else TP_CHECK(cudaMemcpy(t, P.d_tiled[0], tiled.size(), cudaMemcpyDeviceToDevice));
      P.d_tiled.push_back(t);
    }
    // fp16 W for cuBLAS, dequantized on the device from the natural layout, and its copies.
    const size_t wbytes = (size_t)s.n_out * s.n_in * 2;
    const int nw = copies_for(wbytes, d_.l2);
    for (int c = 0; c < nw; ++c) {
      __half* w;
      TP_CHECK(cudaMalloc(&w, wbytes));
      if (c == 0) {
        dequant_additive<<<8 * d_.sms, 256, 0, st_>>>(P.d_codes, P.d_cb, P.d_scales, w, s.n_out, s.n_in);
        TP_LAUNCHED();
        TP_CHECK(cudaStreamSynchronize(st_));
      } else {
        TP_CHECK(cudaMemcpy(w, P.d_W[0], wbytes, cudaMemcpyDeviceToDevice));
      }
      P.d_W.push_back(w);
    }
  }

  void release(Prob& P) {
    cudaFree(P.d_codes);
    cudaFree(P.d_cb);
    cudaFree(P.d_scales);
    cudaFree(P.d_x);
    cudaFree(P.d_y);
    cudaFree(P.d_yref);
    cudaFree(P.d_counters);
    cudaFree(P.d_ws);
    for (auto p : P.d_tiled) cudaFree(p);
    for (auto p : P.d_W) cudaFree(p);
    TP_CHECK(cudaGetLastError());
  }

  void cublas_gemm(const Prob& P, int B, int copy, __half* y) {
    const float one = 1.f, zero = 0.f;
    TP_CUBLAS(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, P.s.n_out, B, P.s.n_in, &one, P.d_W[copy], CUDA_R_16F,
                           P.s.n_in, P.d_x, CUDA_R_16F, P.s.n_in, &zero, y, CUDA_R_16F, P.s.n_out, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT));
  }

  // Plan for one config and slices-a-block; false if it cannot launch.
  bool make_plan(const Shape2& s, const Config& c, int spb, APlan& pl) {
    pl.cfg = &c;
    pl.nslices = cdiv(s.nchunks, c.cps);
    pl.spb = std::min(spb, pl.nslices);
    pl.gridx = cdiv(s.rbs, c.w * c.rpw);
    pl.gridy = cdiv(pl.nslices, pl.spb);
    pl.smem = (size_t)c.nb * c.cps * kGroupsPerChunk * kGS * (c.h ? 2 : 4);
    pl.occ = occupancy2(c.fn, c.w * 32, pl.smem, d_);
    return pl.occ > 0;
  }

  std::vector<APlan> plans_for(const Shape2& s, int B) {
    std::vector<APlan> out;
    const int nb = nb_for(B);
    for (const Config& c : configs()) {
      if (c.nb != nb) continue;
      if (o_.warps && c.w != o_.warps) continue;
      if (o_.rows && c.w * c.rpw * 32 != o_.rows) continue;
      if (o_.cps && c.cps != o_.cps) continue;
      if ((o_.lut == 32 && c.h) || (o_.lut == 16 && !c.h)) continue;
      for (int spb : {1, 2, 4, 8, 16}) {
        if (o_.spb && spb != o_.spb) continue;
        APlan pl;
        if (!make_plan(s, c, spb, pl)) continue;
        if (pl.spb != spb) continue;  // spb above the slice count: the same as a smaller one
        // More slices a block: fewer partials and table builds, the next slice's codes in flight
        // during this one's lookups; but keep at least a block an SM.
        if (spb > 1 && (long long)pl.gridx * pl.gridy < d_.sms) continue;
        out.push_back(pl);
      }
    }
    return out;
  }

  // The untuned plan: 512 rows a block (8 warps x 2 row-blocks), 4 chunks a slice (batch 1), and
  // slices a block raised while the grid stays above ~3 waves (fewer workspace partials).
  APlan heuristic(int B, const std::vector<APlan>& cands) {
    APlan best;
    const int nb = nb_for(B);
    const int cps = nb == 1 ? 4 : nb == 4 ? 2 : 1;
    for (const APlan& p : cands)
      if (p.cfg->w == 8 && p.cfg->rpw == 2 && p.cfg->cps == cps && p.cfg->h == (o_.lut == 16)) {
        if (!best.cfg || ((long long)p.gridx * p.gridy >= 3LL * p.occ * d_.sms && p.spb > best.spb)) best = p;
      }
    if (!best.cfg && !cands.empty()) best = cands.front();
    return best;
  }

  Params params(const Prob& P, const APlan& pl, int B, int copy) const {
    Params g;
    g.codes = P.d_tiled[copy];
    g.cb = P.d_cb;
    g.scales = P.d_scales;
    g.x = P.d_x;
    g.y = P.d_y;
    g.ws = P.d_ws;
    g.counters = P.d_counters;
    g.B = B;
    g.n_in = P.s.n_in;
    g.n_out = P.s.n_out;
    g.rbs = P.s.rbs;
    g.nchunks = P.s.nchunks;
    g.nslices = pl.nslices;
    g.spb = pl.spb;
    return g;
  }

  void ensure_ws(Prob& P, const APlan& pl, int B) {
    const size_t need = (size_t)pl.gridy * B * P.s.n_out;
    if (need > P.ws_floats) {
      TP_CHECK(cudaFree(P.d_ws));
      TP_CHECK(cudaMalloc(&P.d_ws, need * sizeof(float)));
      P.ws_floats = need;
    }
  }

  void launch(const Prob& P, const APlan& pl, int B, int copy) {
    pl.cfg->fn<<<dim3(pl.gridx, pl.gridy), pl.cfg->w * 32, pl.smem, st_>>>(params(P, pl, B, copy));
    TP_LAUNCHED();
  }

  std::vector<double> fetch(const __half* d, size_t n) {
    std::vector<__half> h(n);
    TP_CHECK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<double> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = __half2float(h[i]);
    return v;
  }

  std::vector<double> sampled(const Prob& P, const std::vector<double>& y, int B) {
    std::vector<double> v;
    for (int b = 0; b < B; ++b)
      for (int r : P.sample) v.push_back(y[(size_t)b * P.s.n_out + r]);
    return v;
  }

  std::vector<double> ref64(const Prob& P, int B) {
    std::vector<double> v;
    for (int b = 0; b < B; ++b)
      for (size_t k = 0; k < P.sample.size(); ++k) v.push_back(P.ref64[(size_t)b * P.sample.size() + k]);
    return v;
  }

  // Poisons y (0xFFFF: fp16 NaN) and the workspace, runs once on `copy`, compares with cuBLAS
  // (every output) and float64 (the sampled rows).
  bool check(Prob& P, const APlan& pl, int B, int copy, const std::vector<double>& yref, double& ec, double& e64) {
    const size_t n = (size_t)B * P.s.n_out;
    ensure_ws(P, pl, B);
    TP_CHECK(cudaMemsetAsync(P.d_y, 0xFF, n * 2, st_));
    TP_CHECK(cudaMemsetAsync(P.d_ws, 0xFF, P.ws_floats * sizeof(float), st_));
    launch(P, pl, B, copy);
    TP_CHECK(cudaStreamSynchronize(st_));
    const std::vector<double> y = fetch(P.d_y, n);
    ec = max_rel(y, yref);
    e64 = max_rel(sampled(P, y, B), ref64(P, B));
    return ec <= kTolerance && e64 <= kTolerance;
  }

  void run_shape(const Shape2& s) {
    if (s.n_in % 64 || s.n_in <= 0 || s.n_out <= 0) {
      fprintf(stderr, "in=%d: the additive kernel needs in to be a positive multiple of 64\n", s.n_in);
      ++failures_;
      return;
    }
    const int bmax = *std::max_element(o_.batches.begin(), o_.batches.end());
    Prob P(s, bmax);
    generate(P);
    upload(P);
    const int copies = (int)P.d_tiled.size(), wcopies = (int)P.d_W.size();
    for (int B : o_.batches) {
      const size_t n = (size_t)B * s.n_out;
      TP_CHECK(cudaMemsetAsync(P.d_yref, 0xFF, n * 2, st_));
      cublas_gemm(P, B, 0, P.d_yref);
      TP_CHECK(cudaStreamSynchronize(st_));
      const std::vector<double> yref = fetch(P.d_yref, n);
      const double cublas_err = max_rel(sampled(P, yref, B), ref64(P, B));
      if (cublas_err > kTolerance) {
        printf("FAIL cuBLAS %dx%d B=%d: vs float64 %.3g\n", s.n_in, s.n_out, B, cublas_err);
        ++failures_;
      }
      const Timing tf = time_graph(st_, wcopies, o_.launches, o_.iters, 3, [&](int c) { cublas_gemm(P, B, c, P.d_y); });
      const double fp16_bytes = (double)s.n_out * s.n_in * 2 + 2.0 * B * (s.n_in + s.n_out);
      printf("# %s %dx%d B=%d: cuBLAS fp16 %.4f ms (%.0f GB/s), vs float64 %.2e; %d code copies, %d W copies\n", kScheme,
             s.n_in, s.n_out, B, tf.median, fp16_bytes / (tf.median * 1e-3) / 1e9, cublas_err, copies, wcopies);
      run_kernel(P, B, yref, tf.median, cublas_err);
    }
    release(P);
  }

  void run_kernel(Prob& P, int B, const std::vector<double>& yref, double fp16_ms, double cublas_err) {
    const Shape2& s = P.s;
    const int copies = (int)P.d_tiled.size();
    ARecord r;
    r.kernel = kKernel;
    r.variant = "lut";
    r.batch = B;
    r.in = s.n_in;
    r.out = s.n_out;
    r.fp16_ms = fp16_ms;
    r.cublas_err_fp64 = cublas_err;
    r.copies = copies;
    r.bpw = s.bits_per_weight();
    const double bytes = (double)s.code_bytes() + s.scale_bytes() + s.cb_bytes() + 2.0 * B * (s.n_in + s.n_out);
    std::vector<APlan> cands = plans_for(s, B);
    std::vector<APlan> plans;
    if (o_.tune) plans = cands;
    else if (!cands.empty()) plans.push_back(heuristic(B, cands));
    if (plans.empty()) {
      printf("  %s %dx%d B=%d: no plan\n", kScheme, s.n_in, s.n_out, B);
      r.ok = false;
      r.note = "no plan";
      ++failures_;
      recs_.push_back(r);
      return;
    }
    APlan best;
    double best_ms = INFINITY;
    bool all_ok = true;
    for (const APlan& pl : plans) {
      double ec, e64;
      if (!check(P, pl, B, 0, yref, ec, e64)) {
        printf("FAIL %s %dx%d B=%d [%s]: vs cuBLAS %.3g, vs float64 %.3g\n", kKernel, s.n_in, s.n_out, B,
               pl.key().c_str(), ec, e64);
        all_ok = false;
        ++failures_;
        continue;
      }
      if (plans.size() == 1) { best = pl; break; }
      const Timing t = time_graph(st_, copies, 10, 5, 1, [&](int c) { launch(P, pl, B, c); });
      if (o_.sweep) {
        printf("    sweep %dx%d B=%d [%s] %d blocks/SM, %zu B smem: %.4f ms\n", s.n_in, s.n_out, B, pl.key().c_str(),
               pl.occ, pl.smem, t.median);
        ARecord w = r;
        w.variant = pl.cfg->h ? "lut16" : "lut32";
        w.p = pl;
        w.plan = pl.key();
        w.time_ms = t.median;
        w.gbps = bytes / (t.median * 1e-3) / 1e9;
        w.err_cublas = ec;
        w.err_fp64 = e64;
        w.launches = t.launches;
        sweep_.push_back(w);
      }
      if (t.median < best_ms) { best_ms = t.median; best = pl; }
    }
    if (!best.cfg) {
      r.ok = false;
      r.note = "every plan failed its check";
      recs_.push_back(r);
      return;
    }
    ensure_ws(P, best, B);
    const Timing t = time_graph(st_, copies, o_.launches, o_.iters, 3, [&](int c) { launch(P, best, B, c); });
    double ec, e64;
    const bool ok = check(P, best, B, copies - 1, yref, ec, e64);  // after timing, on another copy
    if (!ok) {
      printf("FAIL %s after timing [%s]: vs cuBLAS %.3g, vs float64 %.3g\n", kKernel, best.key().c_str(), ec, e64);
      ++failures_;
    }
    r.ok = ok && all_ok;
    r.variant = best.cfg->h ? "lut16" : "lut32";
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
    printf("  %s %dx%d B=%d [%s, %d blocks/SM, %zu B smem, %zu plans]: %.4f ms, %.2fx cuBLAS, %.0f GB/s, "
           "err vs cuBLAS %.2e, vs float64 %.2e%s\n",
           kScheme, s.n_in, s.n_out, B, r.plan.c_str(), best.occ, best.smem, plans.size(), t.median, fp16_ms / t.median,
           r.gbps, ec, e64, r.ok ? "" : "  FAIL");
  }

  void print_table() {
    printf("\nMax rel. err = max|y - ref| / max|ref| over all outputs, ref = cuBLAS fp16 GEMM (fp32 accumulate)\n"
           "on the dequantized fp16 weight (float64 on sampled rows is in the JSON). Times: %s.\n\n",
           kMethod);
    printf("| Kernel | Scheme | in x out | batch | Best plan | Latency (ms) | cuBLAS fp16 (ms) | vs cuBLAS | GB/s | Max rel. err |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (const ARecord& r : recs_) {
      if (r.time_ms == 0) {
        printf("| gemv_additive_2bit.cu | %s | %dx%d | %d | - | - | %.4f | - | - | %s |\n", kScheme, r.in, r.out, r.batch,
               r.fp16_ms, r.note.c_str());
        continue;
      }
      printf("| gemv_additive_2bit.cu | %s | %dx%d | %d | %s | %.4f | %.4f | %.2fx | %.0f | %s%.1e |\n", kScheme, r.in,
             r.out, r.batch, r.plan.c_str(), r.time_ms, r.fp16_ms, r.fp16_ms / r.time_ms, r.gbps, r.ok ? "" : "FAIL ",
             r.err_cublas);
    }
  }

  static void json_record(FILE* f, const ARecord& r, bool last) {
    const APlan& p = r.p;
    const bool has = p.cfg != nullptr;
    fprintf(f,
            "    {\"kernel\": \"%s\", \"variant\": \"%s\", \"scheme\": \"%s\", \"K\": %d, \"M\": %d, \"D\": %d, "
            "\"bits_per_weight\": %.6g, \"batch\": %d, \"in_features\": %d, \"out_features\": %d, \"time_ms\": %.6g, "
            "\"fp16_ms\": %.6g, \"speedup\": %.6g, \"gbps\": %.6g, \"max_rel_err\": %.6g, \"max_rel_err_fp64\": %.6g, "
            "\"cublas_rel_err_fp64\": %.6g, \"passed\": %s, \"method\": \"%s\", \"time_ms_min\": %.6g, "
            "\"time_ms_max\": %.6g, \"plan\": \"%s\", \"rb\": %d, \"rows_per_block\": %d, \"warps\": %d, "
            "\"ksplit\": %d, \"cps\": %d, \"groups_per_slice\": %d, \"slices_per_block\": %d, \"grid\": [%d, %d], "
            "\"lut_bits\": %d, \"smem_bytes\": %zu, \"blocks_per_sm\": %d, \"copies\": %d, \"launches_per_graph\": %d}%s\n",
            r.kernel.c_str(), r.variant.c_str(), kScheme, kK, kM, kD, r.bpw, r.batch, r.in, r.out, r.time_ms, r.fp16_ms,
            r.time_ms > 0 ? r.fp16_ms / r.time_ms : 0.0, r.gbps, r.err_cublas, r.err_fp64, r.cublas_err_fp64,
            r.ok ? "true" : "false", kMethod, r.tmin, r.tmax, r.plan.c_str(), has ? p.rb() : 0, has ? p.rb() * 32 : 0,
            has ? p.cfg->w : 0, p.gridy, has ? p.cfg->cps : 0, has ? p.cfg->cps * kGroupsPerChunk : 0, p.spb, p.gridx,
            p.gridy, has ? (p.cfg->h ? 16 : 32) : 0, p.smem, p.occ, r.copies, r.launches, last ? "" : ",");
  }

  void write_json() {
    FILE* f = fopen(o_.json.c_str(), "w");
    if (!f) { fprintf(stderr, "cannot write %s\n", o_.json.c_str()); exit(2); }
    fprintf(f, "{\n  \"device\": {\"name\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, \"l2_bytes\": %zu, "
               "\"runtime\": %d, \"driver\": %d, \"nvcc\": \"%d.%d\"},\n",
            d_.prop.name, d_.prop.major, d_.prop.minor, d_.sms, d_.l2, rt_, drv_, __CUDACC_VER_MAJOR__, __CUDACC_VER_MINOR__);
    fprintf(f, "  \"records\": [\n");
    for (size_t i = 0; i < recs_.size(); ++i) json_record(f, recs_[i], i + 1 == recs_.size());
    fprintf(f, "  ],\n  \"sweep\": [\n");
    for (size_t i = 0; i < sweep_.size(); ++i) json_record(f, sweep_[i], i + 1 == sweep_.size());
    fprintf(f, "  ]\n}\n");
    fclose(f);
    printf("wrote %s\n", o_.json.c_str());
  }
};

}  // namespace add2

int main(int argc, char** argv) {
  const add2::AOptions o = add2::parse_args(argc, argv);
  add2::ARunner run(o);
  return run.run();
}
