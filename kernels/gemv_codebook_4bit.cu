// Fused codebook GEMV for 4-bit codes (K = 16): y[b, o] = sum_i x[b, i] * C[o, q[o, i]],
// fp16 x, C and y, fp32 accumulation, batch 1..16, over trapetum's tiled layout (harness.cuh).
//
//   nvcc -O3 -arch=sm_90 kernels/gemv_codebook_4bit.cu -lcublas -o gemv4 && ./gemv4
//
// Two kernels, both "a lane owns a row": lane l of every warp streams row rb*32 + l, 16 bytes
// (32 codes) a load, and looks its codes up in shared memory laid out [entry][lane], so a warp's
// 32 lookups land in 32 different banks whatever the codes are.
//
//   lut  The numba kernel of trapetum/gemv.py (lut_kernel, commit 6b8b229) written in CUDA C++:
//        fp32 table of the 16 codebook entries, x staged as fp32, one lookup and one FFMA a code.
//        Its plans are the numba planner's (plan_launch / candidate_plans), for side-by-side timing.
//   mma  The same rows, chunks and tables, arranged so a code costs ~1.4 instructions instead of
//        ~4.5: one lookup serves two codes (a byte indexes a 256-entry table of fp16 pairs), the
//        lookup address is one PRMT, and the multiply-add runs on the tensor cores (the looked-up
//        pair is already an mma B-fragment register). See the comment above gemv4_mma.
//   dual The numba kernel trapetum/gemv.py dual_kernel in CUDA C++: mma's table, but the looked-up
//        pairs are the mma's A operand and x sits on B's diagonal, so one mma eats 256 codes (both
//        row-blocks) where mma's eats 128. See the comment above gemv4_dual.
#include "harness.cuh"

using namespace tp;

// ---------------------------------------------------------------------------------------------
// lut: the numba kernel
// ---------------------------------------------------------------------------------------------
// Grid (ceil(rbs / RB), ksplit), W warps. The block owns RB row-blocks and one K-slice of
// cps chunks; warp w takes chunks j0 + w, j0 + w + W, ..., fetching the next chunk of every
// row-block while it computes on the current one. Each x value read from shared memory is used
// for RB rows.
template <int B, int W, int RB>
__global__ void __launch_bounds__(W * 32) gemv4_lut(GemvParams p) {
  constexpr int K = 16, CPB = 32, NT = W * 32, NACC = RB * B;
  constexpr int QUADS = RB * K * 4, QPT = (QUADS + NT - 1) / NT;  // 16-byte pieces of the codebooks
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;
  float* lut = reinterpret_cast<float*>(smem);  // [RB][K][32]
  float* red = lut + RB * K * 32;               // [W][RB][B][32]
  float* xs = red + W * NACC * 32;              // [B][ncols]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rb0 = blockIdx.x * RB, split = blockIdx.y;
  const int j0 = split * p.cps, j1 = min(j0 + p.cps, p.nchunks), ncols = (j1 - j0) * CPB;

  auto fetch = [&](uint4(&dst)[RB], int j) {
#pragma unroll
    for (int r = 0; r < RB; ++r)
      dst[r] = (rb0 + r < p.rbs && j < j1) ? ld_stream(p.codes + ((size_t)(rb0 + r) * p.nchunks + j) * 32 + lane)
                                           : make_uint4(0, 0, 0, 0);
  };
  // Start streaming codes before anything waits: this warp's first chunk of each row-block.
  int j = j0 + warp;
  uint4 cur[RB];
  fetch(cur, j);

  // Codebooks -> fp32 LUT: every 16-byte load issued before the first store waits on one.
  uint4 buf[QPT];
#pragma unroll
  for (int i = 0; i < QPT; ++i) {
    const int q = tid + i * NT, r = q / (K * 4);
    buf[i] = (q < QUADS && rb0 + r < p.rbs) ? __ldg(p.cb + (size_t)(rb0 + r) * K * 4 + (q - r * K * 4))
                                            : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < QPT; ++i) {
    const int q = tid + i * NT;
    if (q < QUADS) {
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const uint32_t wv = word(buf[i], h);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&wv));
        lut[q * 8 + 2 * h] = f.x;
        lut[q * 8 + 2 * h + 1] = f.y;
      }
    }
  }
  // This block's slice of x -> fp32, 8 values a 16-byte load.
  const int xq = ncols / 8;
  for (int t = tid; t < B * xq; t += NT) {
    const int bb = t / xq, q = t - bb * xq;
    const uint4 v = __ldg(p.x + (size_t)bb * (p.n_in / 8) + j0 * (CPB / 8) + q);
    float* o = xs + bb * ncols + q * 8;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const uint32_t wv = word(v, h);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&wv));
      o[2 * h] = f.x;
      o[2 * h + 1] = f.y;
    }
  }
  __syncthreads();

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  while (j < j1) {
    uint4 nxt[RB];
    fetch(nxt, j + W);
    const float* xc = xs + (j - j0) * CPB;
#pragma unroll
    for (int q = 0; q < 4; ++q)      // words of the chunk: 8 columns each
#pragma unroll
      for (int g = 0; g < 2; ++g) {  // 4 columns at a time: one 16-byte broadcast read of x
        float v[RB][4];
#pragma unroll
        for (int r = 0; r < RB; ++r)
#pragma unroll
          for (int k = 0; k < 4; ++k)
            v[r][k] = lut[(r * K + ((word(cur[r], q) >> (4 * (4 * g + k))) & 15u)) * 32 + lane];
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const float4 x4 = *reinterpret_cast<const float4*>(xc + b * ncols + q * 8 + 4 * g);
#pragma unroll
          for (int r = 0; r < RB; ++r)
            acc[r * B + b] = fmaf(v[r][3], x4.w, fmaf(v[r][2], x4.z, fmaf(v[r][1], x4.y, fmaf(v[r][0], x4.x, acc[r * B + b]))));
        }
      }
#pragma unroll
    for (int r = 0; r < RB; ++r) cur[r] = nxt[r];
    j += W;
  }
#pragma unroll
  for (int i = 0; i < NACC; ++i) red[(warp * NACC + i) * 32 + lane] = acc[i];
  __syncthreads();
  finish_rows<RB, W, false>(red, p, &s_last);
}

// ---------------------------------------------------------------------------------------------
// mma: pair lookups, multiply-add on the tensor cores
// ---------------------------------------------------------------------------------------------
// Grid (ceil(rbs / 2), ksplit), W warps: warps with warp % 2 == g stream row-block 2*bx + g, so
// one block's table serves 64 rows (see the address below for why two).
//
// Table: for each code byte (two columns: low nibble the even one) and lane, the fp16 pair
// (C[lo], C[hi]) as one 32-bit word at tab[byte][g][lane], byte stride 256. The lookup address
// (byte << 8) | (g << 7) | (lane << 2) is one PRMT of the code word and a per-lane constant, and
// the 128 bytes of each 256 that one row-block would leave empty hold the other row-block.
//
// Tensor cores: mma.m16n8k16 takes B (16 x 8) from lanes 4n + t, each holding k = 2t, 2t+1
// (register b0) and 2t+8, 2t+9 (b1) of column n. Here lane L = 4n + t feeds two looked-up pairs
// of ITS OWN row, so the four lanes of a quad feed four different rows into one column n. A keeps
// them apart: A[m][k] is x only where m % 4 == (k % 8) / 2, i.e. lane t's k-slots meet A row
// m = t (+4 per batch), and D[m][n] collects row 4n + m % 4 of batch m / 4:
//   A row m = 4*bq + t, cols (2t, 2t+1 | 2t+8, 2t+9) = x[batch 4G+bq] at the step's columns,
//   zero elsewhere. In the A fragment (lane g' = L>>2, t' = L&3 holds rows g', g'+8 at cols
//   2t', 2t'+1 and +8) only the 8 "diagonal" lanes with g' % 4 == t' hold x; the others keep zeros.
// So one mma eats 128 codes of 32 rows for up to 4 batches; batches 5..16 take one mma per 4.
// Step s of a chunk uses bytes 2s, 2s+1 (columns 4s..4s+3); x of a word (8 columns, 16 bytes of
// fp16) is one shared load that serves two steps.
// The two tensor-core kernels' prologue: both row-blocks' codebooks ([k][lane] fp16, 1 KB each,
// at cbs + g * kPairCbBytes) and the x slice (fp16, xrow bytes a batch row) staged, then the pair
// table built: item = (byte, row-block, 4 lanes), one 16-byte store of tab[byte][row-block][lane].
constexpr int kPairCbBytes = 16 * 64 + 64;  // one row-block's staged codebooks; +64 B: the two sit in other banks
constexpr int kPairXChunk = 64;             // x bytes of a chunk (32 columns, fp16)
template <int NT>
__device__ __forceinline__ void stage_pair_table(const GemvParams& p, unsigned char* tab, unsigned char* xs, unsigned char* cbs,
                                                 int bx, int j0, int jend, int xrow, int tid) {
  for (int q = tid; q < 128; q += NT) {
    const int gq = q >> 6, r = bx * 2 + gq;
    const uint4 v = r < p.rbs ? __ldg(p.cb + (size_t)r * 64 + (q & 63)) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(cbs + gq * kPairCbBytes + (q & 63) * 16) = v;
  }
  const int xq = (jend - j0) * (kPairXChunk / 16);  // 16-byte pieces a batch row
  for (int t = tid; t < p.B * xq; t += NT) {
    const int bb = t / xq, q = t - bb * xq;
    *reinterpret_cast<uint4*>(xs + bb * xrow + q * 16) = __ldg(p.x + (size_t)bb * (p.n_in / 8) + j0 * (kPairXChunk / 16) + q);
  }
  __syncthreads();
  for (int it = tid; it < 256 * 16; it += NT) {
    const int lq = it & 7, gq = (it >> 3) & 1, byte = it >> 4;
    const unsigned char* cb = cbs + gq * kPairCbBytes + lq * 8;
    const uint2 lo = *reinterpret_cast<const uint2*>(cb + (byte & 15) * 64);  // C[lo] of lanes 4lq..4lq+3
    const uint2 hi = *reinterpret_cast<const uint2*>(cb + (byte >> 4) * 64);
    uint4 e;
    e.x = __byte_perm(lo.x, hi.x, 0x5410);  // lane 4lq:   (C[lo], C[hi])
    e.y = __byte_perm(lo.x, hi.x, 0x7632);  // lane 4lq+1
    e.z = __byte_perm(lo.y, hi.y, 0x5410);
    e.w = __byte_perm(lo.y, hi.y, 0x7632);
    *reinterpret_cast<uint4*>(tab + byte * 256 + gq * 128 + lq * 16) = e;
  }
  __syncthreads();
}

template <int NB, int W>
__global__ void __launch_bounds__(W * 32) gemv4_mma(GemvParams p) {
  constexpr int W2 = W / 2, G = (NB + 3) / 4, NT = W * 32, U = kMmaUnroll;
  constexpr bool HI = NB > 2;    // batches 2, 3 of each group ride in A rows 8..15 (a1, a3)
  constexpr int TAB = 256 * 256;  // [byte][row-block][lane] fp16 pairs
  constexpr int XCH = kPairXChunk;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;
  const int B = p.B;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = warp & 1, wg = warp >> 1;
  const int bx = blockIdx.x, split = blockIdx.y;
  const int rb = bx * 2 + g;
  const int j0 = split * p.cps, jend = min(j0 + p.cps, p.nchunks);
  const int j1 = rb < p.rbs ? jend : j0;  // an odd row-block count leaves the last block's g=1 idle
  const int xrow = p.cps * XCH + 16;
  unsigned char* tab = smem;
  unsigned char* xs = smem + max(TAB, W * B * 32 * 4);  // [B][xrow]
  unsigned char* cbs = xs + B * xrow;                   // [2][kPairCbBytes]

  // Start streaming codes before anything waits: this warp's first U chunks.
  const uint4* src = p.codes + (size_t)rb * p.nchunks * 32 + lane;  // chunk j at src[j * 32]
  uint4 c[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int jj = j0 + wg + u * W2;
    c[u] = jj < j1 ? ld_stream(src + (size_t)jj * 32) : make_uint4(0, 0, 0, 0);
  }

  stage_pair_table<NT>(p, tab, xs, cbs, bx, j0, jend, xrow, tid);

  // This lane's x rows in the A fragment: batch 4G + (lane >> 4) (a0, a2) and that + 2 (a1, a3),
  // only on the diagonal lanes; every other lane's x registers stay zero for the whole kernel.
  const bool diag = ((lane >> 2) & 3) == (lane & 3);
  bool oka[G], okb[G];
  int xoa[G], xob[G];
  uint4 xa[G], xb[G];
  float acc[G][4];
#pragma unroll
  for (int gg = 0; gg < G; ++gg) {
    const int ba = 4 * gg + (lane >> 4);
    oka[gg] = diag && ba < B;
    okb[gg] = diag && ba + 2 < B;
    xoa[gg] = ba * xrow;
    xob[gg] = (ba + 2) * xrow;
    xa[gg] = xb[gg] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[gg][i] = 0.f;
  }
  const uint32_t lb = (uint32_t)(lane << 2) | (uint32_t)(g << 7);  // byte 0 of every lookup address

  for (int j = j0 + wg; j < j1; j += U * W2) {
    uint4 n[U];  // the next U chunks fly while these U are used
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int jj = j + (U + u) * W2;
      n[u] = jj < j1 ? ld_stream(src + (size_t)jj * 32) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int jj = j + u * W2;
      if (jj < j1) {
        const unsigned char* xc = xs + (jj - j0) * XCH;
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // word w: bytes 4w..4w+3, columns 8w..8w+7
          const uint32_t cw = word(c[u], w);
#pragma unroll
          for (int gg = 0; gg < G; ++gg) {
            if (oka[gg]) xa[gg] = *reinterpret_cast<const uint4*>(xc + xoa[gg] + 16 * w);
            if (HI && okb[gg]) xb[gg] = *reinterpret_cast<const uint4*>(xc + xob[gg] + 16 * w);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // step: bytes 2h, 2h+1 of the word
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(tab + __byte_perm(cw, lb, 0x5504 | ((2 * h) << 4)));
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(tab + __byte_perm(cw, lb, 0x5504 | ((2 * h + 1) << 4)));
#pragma unroll
            for (int gg = 0; gg < G; ++gg)
              mma_16816(acc[gg], word(xa[gg], 2 * h), HI ? word(xb[gg], 2 * h) : 0u, word(xa[gg], 2 * h + 1),
                        HI ? word(xb[gg], 2 * h + 1) : 0u, b0, b1);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) c[u] = n[u];
  }

  __syncthreads();  // every warp is done with the table: the partials reuse its space
  float* red = reinterpret_cast<float*>(smem);  // [W][B][32]
  // D fragment: lane (g', t') holds D[g'][2t'], D[g'][2t'+1], D[g'+8][2t'], D[g'+8][2t'+1];
  // D[m][n] is row 4n + m % 4 of batch 4G + m / 4.
#pragma unroll
  for (int gg = 0; gg < G; ++gg)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = 4 * gg + (lane >> 4) + (i >> 1) * 2;
      const int r = 8 * (lane & 3) + (i & 1) * 4 + ((lane >> 2) & 3);
      if (b < B) red[(warp * B + b) * 32 + r] = acc[gg][i];
    }
  __syncthreads();
  finish_rows<2, W, true>(red, p, &s_last);
}

// ---------------------------------------------------------------------------------------------
// dual: the looked-up pairs as the mma's A operand, x on B's diagonal
// ---------------------------------------------------------------------------------------------
// Grid, table, staging and finish as gemv4_mma's; what differs is the fragment a lookup feeds.
// Every warp streams *both* row-blocks (lane L's row L in each), and a lane's four A registers
// are the pairs of its two rows at the same four columns: a0, a2 (row-block 0: bytes 2h, 2h+1 of
// its code word), a1, a3 (row-block 1). So A row g (g + 8) holds, in k-slots 2t, 2t+1, 2t+8, 2t+9,
// row 4g + t of row-block 0 (1). B keeps the lanes apart: column n = 4b + t holds batch b's x at
// lane t's four k-slots only (lanes 4n + t with n % 4 == t hold x, the others zeros), so D[g][n]
// is row 4g + n % 4 of row-block 0 against batch n / 4, and D[g + 8][n] the same of row-block 1.
// One m16n8k16 eats 256 codes (4 lookups a lane) for 2 batches; batches 3..8 add an mma per 2.
template <int NB, int W>
__global__ void __launch_bounds__(W * 32) gemv4_dual(GemvParams p) {
  constexpr int G = (NB + 1) / 2, NT = W * 32, U = W >= 16 ? 1 : 2;  // U: numba's tuned unroll (16 warps: 1)
  constexpr int TAB = 256 * 256, XCH = kPairXChunk;
  static_assert(2 * W * NB * 32 * 4 <= TAB, "both row-blocks' partials of every warp go over the table");
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;
  const int B = p.B;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int bx = blockIdx.x, split = blockIdx.y;
  const int j0 = split * p.cps, j1 = min(j0 + p.cps, p.nchunks);
  const int xrow = p.cps * XCH + 16;
  unsigned char* tab = smem;
  unsigned char* xs = smem + max(TAB, W * B * 32 * 4);  // as mma_smem lays it out
  unsigned char* cbs = xs + B * xrow;
  // An odd row-block count: the last block's second row-block re-reads the first's codes; its
  // table is zeros (the staged codebooks are) and its rows are past n_out, never written.
  const int rb0 = bx * 2, rb1 = rb0 + 1 < p.rbs ? rb0 + 1 : rb0;
  const uint4* src0 = p.codes + (size_t)rb0 * p.nchunks * 32 + lane;
  const uint4* src1 = p.codes + (size_t)rb1 * p.nchunks * 32 + lane;
  const uint4 z = make_uint4(0, 0, 0, 0);
  auto fetch = [&](uint4(&dst)[2], int jj) {  // chunk jj of both row-blocks
    dst[0] = jj < j1 ? ld_stream(src0 + (size_t)jj * 32) : z;
    dst[1] = jj < j1 ? ld_stream(src1 + (size_t)jj * 32) : z;
  };

  uint4 c[U][2];
#pragma unroll
  for (int u = 0; u < U; ++u) fetch(c[u], j0 + warp + u * W);
  stage_pair_table<NT>(p, tab, xs, cbs, bx, j0, j1, xrow, tid);  // gemv4_mma's

  // B fragments: lane 4n + t holds batch 2gg + n / 4's x only where n % 4 == t (the diagonal).
  const bool diag = ((lane >> 2) & 3) == (lane & 3);
  bool ok[G];
  int xo[G];
  uint4 xv[G];
  float acc[G][4];
#pragma unroll
  for (int gg = 0; gg < G; ++gg) {
    const int b = 2 * gg + (lane >> 4);
    ok[gg] = diag && b < B;
    xo[gg] = b * xrow;
    xv[gg] = z;
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[gg][i] = 0.f;
  }
  // Lookups and x reads at shared-window addresses from the dynamic array's symbol (a constant):
  // ptxas can fold it into each LDS instead of adding a register base to every address.
  uint32_t smem_s;
  asm("mov.u32 %0, smem;" : "=r"(smem_s));
  const uint32_t xs_s = smem_s + (uint32_t)(xs - smem);
  const uint32_t lb = (uint32_t)(lane << 2);  // byte 0 of a row-block-0 lookup's address (| 128: row-block 1)

  for (int j = j0 + warp; j < j1; j += U * W) {
    uint4 n[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) fetch(n[u], j + (U + u) * W);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int jj = j + u * W;
      if (jj < j1) {
        const uint32_t xc = xs_s + (uint32_t)((jj - j0) * XCH);
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // word w: columns 8w..8w+7 of both row-blocks
          const uint32_t c0 = word(c[u][0], w), c1 = word(c[u][1], w);
#pragma unroll
          for (int gg = 0; gg < G; ++gg)
            if (ok[gg]) xv[gg] = lds128(xc + (uint32_t)(xo[gg] + 16 * w));
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // step h: bytes 2h, 2h+1 (columns 8w + 4h .. +3)
            const uint32_t a0 = lds32(smem_s + __byte_perm(c0, lb, 0x5504 | ((2 * h) << 4)));
            const uint32_t a2 = lds32(smem_s + __byte_perm(c0, lb, 0x5504 | ((2 * h + 1) << 4)));
            const uint32_t a1 = lds32(smem_s + __byte_perm(c1, lb | 128u, 0x5504 | ((2 * h) << 4)));
            const uint32_t a3 = lds32(smem_s + __byte_perm(c1, lb | 128u, 0x5504 | ((2 * h + 1) << 4)));
#pragma unroll
            for (int gg = 0; gg < G; ++gg) mma_16816(acc[gg], a0, a1, a2, a3, word(xv[gg], 2 * h), word(xv[gg], 2 * h + 1));
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) c[u][0] = n[u][0], c[u][1] = n[u][1];
  }

  __syncthreads();  // every warp is done with the table: the partials reuse its space
  float* red = reinterpret_cast<float*>(smem);  // [2W][B][32]: set 2 * warp + row-block
  // D fragment: lane (g, t) holds D[g][2t + i], D[g + 8][2t + i] (i = 0, 1): column n = 2t + i is
  // batch 2gg + n / 4, row 4g + n % 4 of row-block 0 (1).
#pragma unroll
  for (int gg = 0; gg < G; ++gg)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = 2 * gg + ((lane & 3) >> 1);
      const int r = 4 * (lane >> 2) + 2 * (lane & 1) + (i & 1);
      if (b < B) red[((2 * warp + (i >> 1)) * B + b) * 32 + r] = acc[gg][i];
    }
  __syncthreads();
  finish_rows<2, W, true, 2 * W>(red, p, &s_last);
}

// ---------------------------------------------------------------------------------------------
// Instantiation tables
// ---------------------------------------------------------------------------------------------
template <int B, int W>
static KernelFn lut_rb(int RB) {
  // RB above gemv.row_blocks_per_block(16, B) is never planned; leave those uncompiled.
  constexpr int rbmax = B <= 2 ? 4 : (B <= 8 ? 2 : 1);
  switch (RB) {
    case 1: return gemv4_lut<B, W, 1>;
    case 2: if constexpr (rbmax >= 2) return gemv4_lut<B, W, 2>; else return nullptr;
    case 4: if constexpr (rbmax >= 4) return gemv4_lut<B, W, 4>; else return nullptr;
  }
  return nullptr;
}

template <int B>
static KernelFn lut_w(int W, int RB) {
  return W == 8 ? lut_rb<B, 8>(RB) : W == 4 ? lut_rb<B, 4>(RB) : nullptr;
}

static KernelFn get_lut(int K, int B, int W, int RB) {
  if (K != 16) return nullptr;
  switch (B) {
    case 1: return lut_w<1>(W, RB);   case 2: return lut_w<2>(W, RB);   case 3: return lut_w<3>(W, RB);
    case 4: return lut_w<4>(W, RB);   case 5: return lut_w<5>(W, RB);   case 6: return lut_w<6>(W, RB);
    case 7: return lut_w<7>(W, RB);   case 8: return lut_w<8>(W, RB);   case 9: return lut_w<9>(W, RB);
    case 10: return lut_w<10>(W, RB); case 11: return lut_w<11>(W, RB); case 12: return lut_w<12>(W, RB);
    case 13: return lut_w<13>(W, RB); case 14: return lut_w<14>(W, RB); case 15: return lut_w<15>(W, RB);
    case 16: return lut_w<16>(W, RB);
  }
  return nullptr;
}

template <int NB>
static KernelFn mma_w(int W) {
  return W == 4 ? gemv4_mma<NB, 4> : W == 8 ? gemv4_mma<NB, 8> : W == 16 ? gemv4_mma<NB, 16> : nullptr;
}

static KernelFn get_mma(int K, int B, int W) {
  if (K != 16) return nullptr;
  // The batch is a run-time argument up to the compiled bound; the bound sets the mma count.
  return B <= 2 ? mma_w<2>(W) : B <= 4 ? mma_w<4>(W) : B <= 8 ? mma_w<8>(W) : B <= 12 ? mma_w<12>(W) : mma_w<16>(W);
}

template <int NB>
static KernelFn dual_w(int W) {
  return W == 4 ? gemv4_dual<NB, 4> : W == 8 ? gemv4_dual<NB, 8> : W == 16 ? gemv4_dual<NB, 16> : nullptr;
}

static KernelFn get_dual(int K, int B, int W) {
  // numba's tuner tries dual up to batch 8 (gemv.DUAL_MAX_TUNED); so does this program
  if (K != 16 || B > 8) return nullptr;
  return B <= 2 ? dual_w<2>(W) : B <= 4 ? dual_w<4>(W) : dual_w<8>(W);
}

static bool plan_lut4(const Shape& s, int B, const Request& rq, const DeviceInfo& d, Plan& pl, std::string& why) {
  return plan_lut(s, B, rq, d, get_lut, pl, why);
}

static bool plan_mma4(const Shape& s, int B, const Request& rq, const DeviceInfo& d, Plan& pl, std::string& why) {
  const MmaGeometry g{256 * 256, 2 * (16 * 64 + 64), 64};
  return plan_mma(s, B, rq, d, g, get_mma, pl, why);
}

static bool plan_dual4(const Shape& s, int B, const Request& rq, const DeviceInfo& d, Plan& pl, std::string& why) {
  const MmaGeometry g{256 * 256, 2 * (16 * 64 + 64), 64};
  return plan_mma(s, B, rq, d, g, get_dual, pl, why);
}

// Every warp streams both row-blocks: worth timing where each gets its unroll's chunks at least.
static bool dual_keep(const Plan& p) { return p.cps >= p.warps * (p.warps >= 16 ? 1 : 2); }

int main(int argc, char** argv) {
  const Scheme sc{"cuda_cpp_4bit", "gemv_codebook_4bit.cu", {16}};
  const Options o = parse(argc, argv, sc);
  const std::vector<Variant> vs = {
      {"lut", plan_lut4, lut_candidates, lut_keep},
      {"mma", plan_mma4, mma_candidates, mma_keep},
      {"dual", plan_dual4, mma_candidates, dual_keep},
  };
  Runner run(sc, vs, o);
  return run.run();
}
