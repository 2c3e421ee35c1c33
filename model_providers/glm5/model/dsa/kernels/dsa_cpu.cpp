// Sparse MLA (absorbed form) forward and backward for CPU ranks, fused per query: each query's
// selected latent rows are read a key block at a time: fp32 rows in place, other dtypes upcast into
// a thread-local block buffer, their next block prefetched into L2 while this block's GEMMs run.
// torch's own gather + bmm writes and rereads every query's k x 576 rows through memory, which is
// what held the op-by-op version at ~55% of the GEMM ceiling. The GEMMs are this file's
// register-tiled micro-kernels (one side is the n heads: BLAS ran those shapes at 2/3 of its
// square-GEMM rate, packing panels it reads once); queries are split over the intra-op threads.
// Semantics, shapes and precision are those of sparse_attention.SparseLatentAttention: fp32
// statistics (scores, log-sum-exp, probabilities, delta, dq/dkv sums), the inputs upcast a
// row at a time, only o, dq and dkv rounded to the input dtype.
//
// Determinism: in the backward, thread t (of at most 8) owns a fixed contiguous range of queries
// and adds its kv gradient into its own fp32 buffer in query order; the buffers are summed in
// thread order. The result depends on the thread count only (the same count gives bitwise the
// same gradient).
#include <ATen/ATen.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// An additive mask over one query's k selected keys: -inf where the key is hidden, 0 elsewhere
// (all 0 without a valid mask), so masked and unmasked rows take the same vector loops.
inline void hidden_keys(float* hide, const bool* valid, int64_t k) {
  for (int64_t j = 0; j < k; ++j) hide[j] = valid && !valid[j] ? kNegInf : 0.f;
}

// exp(x) for x <= 0 (every exponent here is a score minus a running max or a log-sum-exp): 2^j *
// p(r) with j = round(x / ln2), r = x - j ln2, |r| <= ln2 / 2, and the degree-7 Taylor polynomial
// (truncation 3e-9, below fp32 rounding: a degree-6 one is 1.2e-7 low on one side, a bias that a
// sum of thousands of terms keeps; log-sum-exps and the indexer KL drifted by ~1e-7 per row);
// x <= -87 (and -inf) gives 0. One template for a float and for a SIMD vector of floats (GCC
// vector extensions: AVX-512, AVX2 or NEON code from the same source), so the vector loops and
// their scalar tails compute the same values. No branch and no libm call: GCC does not vectorise
// a loop over the scalar form written with std::max and std::nearbyint (it turns the clamp into
// a jump; ~6 ns a value on an AVX2 EPYC). With it, the dense KL target's max / exp / head-sum row
// work went from 82 to 38 ms per 16.8M scores on one thread.
//
// The vector width is the CPU's own (16 floats with AVX-512, else 8) unless the build names one
// (SPARSE_MLA_LANES, from dsa_cpu.py). The width sets the tiles and the order of every
// lane-split sum, so the two widths round differently; each width's arithmetic is the same on any
// x86 CPU with AVX2 and FMA (GCC lowers a 16-lane vector to two 8-lane halves, lane for lane, and
// contracts the same multiply-adds), which is how one kind of machine tests the other's path.
#if defined(SPARSE_MLA_LANES)
constexpr int64_t kLanes = SPARSE_MLA_LANES;
#elif defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
static_assert(kLanes == 8 || kLanes == 16, "SPARSE_MLA_LANES is 8 (the AVX2 path) or 16 (the AVX-512 path)");
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef double VecD __attribute__((vector_size(kLanes * sizeof(double))));

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_vec(float* p, const VecF& v) { std::memcpy(p, &v, sizeof(v)); }
inline VecF splat(float x) { return x - VecF{}; }  // x - 0 is x for every x (0 + x is not: -0), so it folds to a broadcast

inline int32_t to_int(float x) { return static_cast<int32_t>(x); }
inline VecI to_int(const VecF& x) { return __builtin_convertvector(x, VecI); }
inline float from_bits(int32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline VecF from_bits(const VecI& b) {
  VecF f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

template <typename V>
inline V filled(float x) {
  if constexpr (std::is_same_v<V, float>)
    return x;
  else
    return splat(x);
}

template <typename V>
inline V exp_nonpositive(V x) {
  const V floor = filled<V>(-87.0f);
  const V xc = x > floor ? x : floor;  // a select: -inf and NaN stay out of the polynomial
  const V round = xc * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23 rounds to an integer
  const V j = round - 12582912.0f;
  const V r = xc - j * 0.693145751953125f - j * 1.428606765330187045e-06f;
  V p = r * (1.0f / 5040) + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V e = p * from_bits((to_int(j) + 127) << 23);
  return x > floor ? e : filled<V>(0.0f);
}

// The largest of x[0..n) (-inf for n = 0; NaN never wins, as with std::max(m, x)).
inline float max_of(const float* x, int64_t n) {
  VecF mv = splat(kNegInf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VecF v = load_vec(x + j);
    mv = v > mv ? v : mv;
  }
  float m = kNegInf;
  for (int64_t i = 0; i < kLanes; ++i) m = std::max(m, mv[i]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// out[j] = exp(x[j] - m) for j < n (out may be x); returns their sum, per lane in double and the
// lanes added in order (a float running sum over thousands of terms is off by ~1e-7 relative).
inline double exp_shifted(float* out, const float* x, int64_t n, float m) {
  VecD acc = VecD{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VecF e = exp_nonpositive(load_vec(x + j) - m);
    store_vec(out + j, e);
    acc += __builtin_convertvector(e, VecD);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < kLanes; ++i) sum += acc[i];
  for (; j < n; ++j) {
    out[j] = exp_nonpositive(x[j] - m);
    sum += out[j];
  }
  return sum;
}

// sum_j a[j] b[j] for j < n, in per-lane partial sums (a float running sum has a dependency chain
// GCC may not break without -ffast-math).
inline float dot(const float* a, const float* b, int64_t n) {
  VecF acc = VecF{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc += load_vec(a + j) * load_vec(b + j);
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += acc[i];
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// acc[j] += exp(x[j] - m) for j < n.
inline void add_exp_shifted(float* acc, const float* x, int64_t n, float m) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store_vec(acc + j, load_vec(acc + j) + exp_nonpositive(load_vec(x + j) - m));
  for (; j < n; ++j) acc[j] += exp_nonpositive(x[j] - m);
}

template <typename T>
inline void load_row(float* dst, const T* src, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t d, float scale) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// Rows are picked at random positions of a sequence that outgrows the caches at long context: a
// row's first cache lines miss before the hardware prefetcher sees its stream. Loops over
// selected rows ask for the row kPrefetchRows ahead (measured: 4 to 16 all help, 8 most).
constexpr int64_t kPrefetchRows = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t d, bool for_write = false) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < d * static_cast<int64_t>(sizeof(T)); c += 64)
    for_write ? __builtin_prefetch(p + c, 1) : __builtin_prefetch(p + c, 0);
}

// Rows idx[0..rows) of kv [L, d] copied into buf [rows, d] (fp32); rows up to idx[ahead) are asked
// for kPrefetchRows ahead (the next key block's first rows while this block's last ones are copied).
template <typename T>
inline void gather_rows(float* buf, const T* kv, const int64_t* idx, int64_t rows, int64_t ahead, int64_t d,
                        int64_t L) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t next = r + kPrefetchRows;
    if (next < ahead && idx[next] >= 0 && idx[next] < L) prefetch_row(kv + idx[next] * d, d);
    TORCH_CHECK(idx[r] >= 0 && idx[r] < L, "sparse MLA: key index ", idx[r], " outside [0, ", L, ")");
    load_row(buf + r * d, kv + idx[r] * d, d);
  }
}

// The micro-kernels' two ways to reach their rows: rows of one buffer (a stride apart), or a
// pointer per row.
struct StridedRows {
  const float* base;
  int64_t ld;
  const float* operator[](int64_t j) const { return base + j * ld; }
  StridedRows from(int64_t j) const { return {base + j * ld, ld}; }
};
struct PointedRows {
  const float* const* at;
  const float* operator[](int64_t j) const { return at[j]; }
  PointedRows from(int64_t j) const { return {at + j}; }
};

// Rows idx[0..rows) of kv [L, d] for the micro-kernels: fp32 rows are read where they lie (a copy
// cost a load and a store per value and the GEMMs' reads of it), other dtypes are upcast into buf
// first (their next block's lines already on their way to L2, see LinePrefetch).
template <typename T>
inline PointedRows select_rows(const float** at, float* buf, const T* kv, const int64_t* idx, int64_t rows,
                               int64_t ahead, int64_t d, int64_t L) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(idx[r] >= 0 && idx[r] < L, "sparse MLA: key index ", idx[r], " outside [0, ", L, ")");
      at[r] = kv + idx[r] * d;
    }
  } else {
    gather_rows(buf, kv, idx, rows, ahead, d, L);
    for (int64_t r = 0; r < rows; ++r) at[r] = buf + r * d;
  }
  return {at};
}

// Micro-kernels for the sparse core's GEMMs. One side of each is small (the n heads, or 2n), so
// BLAS runs them far from its peak (MKL: ~49 GFLOP/s a core at 16 rows against ~73 for square
// shapes, much of it spent packing panels it reads once). Each kernel below keeps a tile of outputs
// in vector registers (kAccRegs accumulators) and streams the other side once: the FMA ports, not
// the loads, bound it. Sums run over the inner index in order (deterministic, thread-count free).
constexpr int kAccRegs = kLanes == 16 ? 24 : 12;  // of AVX-512's 32 / AVX2's 16 vector registers

// The next key block's latent rows, asked for (into L2) a cache line at a time from inside the
// current block's GEMM loops: memory then works while the FMA units do. Prefetching a row just
// before its copy left the memory idle during the GEMMs and the GEMMs waiting during the copy
// (perf: a third of the forward's time sat on the gather's loads and prefetches). A line every
// 4th step of both the rows-times-panel and the panel-times-rows loops spreads them over the whole
// block: every 2nd step of the first loop alone kept so many misses in flight that ~30% of that
// loop's samples sat on the prefetch instruction (paired runs on fp32 rows, then prefetched too:
// fwd and bwd 1.5-5% faster spread). Only for rows that are upcast into the block buffer (bf16/fp16: without it, paired runs at 8K
// and 32K took 1.04-1.11x as long). fp32 rows are read in place by the GEMMs, each a sequential
// stream the hardware prefetchers follow: there the software prefetches cost more than they saved
// (paired runs, 512 queries, k 2048, 2 threads, time without / with: fwd 1.01 / 1.01 / 0.87 and
// bwd 0.93 / 0.95 / 0.88 at L 8K / 16K / 32K).
struct LinePrefetch {
  const char* kv = nullptr;
  const int64_t* idx = nullptr;
  int64_t rows = 0, row_bytes = 0, L = 0, row = 0, off = 0;
  template <typename T>
  void ask_for(const T* kv_rows, const int64_t* ix, int64_t n, int64_t d, int64_t len) {
    kv = reinterpret_cast<const char*>(kv_rows), idx = ix, rows = n, row_bytes = d * sizeof(T), L = len;
    row = off = 0;
  }
  template <typename T>
  static LinePrefetch* for_rows_of(LinePrefetch& pf) {
    return std::is_same_v<T, float> ? nullptr : &pf;
  }
  void step() {
    if (row >= rows) return;
    if (idx[row] >= 0 && idx[row] < L) __builtin_prefetch(kv + idx[row] * row_bytes + off, 0, 2);
    if ((off += 64) >= row_bytes) off = 0, ++row;
  }
};

// c[h * ldc + j] = sum_p rows[j][p] panel[p * np + h] for j < m, h < nh (nh <= V lanes):
// R rows against V vectors of heads. `panel` is the small side transposed ([d, np]).
template <int R, int V, typename Rows>
inline void rows_panel_tile(float* c, int64_t ldc, const Rows& rows, const float* panel, int64_t np, int64_t d,
                            int64_t nh, LinePrefetch* pf) {
  const float* row[R];
  for (int r = 0; r < R; ++r) row[r] = rows[r];
  VecF acc[R][V] = {};
  for (int64_t p = 0; p < d; ++p) {
    if (pf && p % 4 == 0) pf->step();
    VecF w[V];
    for (int v = 0; v < V; ++v) w[v] = load_vec(panel + p * np + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VecF x = splat(row[r][p]);
      for (int v = 0; v < V; ++v) acc[r][v] += x * w[v];
    }
  }
  float tmp[V * kLanes];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) store_vec(tmp + v * kLanes, acc[r][v]);
    for (int64_t h = 0; h < nh; ++h) c[h * ldc + r] = tmp[h];
  }
}

template <int V, typename Rows>
void rows_panel(float* c, int64_t ldc, const Rows& rows, int64_t m, const float* panel, int64_t np, int64_t d,
                int64_t nh, LinePrefetch* pf) {
  constexpr int R = kAccRegs / V;
  int64_t j = 0;
  for (; j + R <= m; j += R) rows_panel_tile<R, V>(c + j, ldc, rows.from(j), panel, np, d, nh, pf);
  for (; j + 4 <= m; j += 4) rows_panel_tile<4, V>(c + j, ldc, rows.from(j), panel, np, d, nh, pf);
  for (; j + 2 <= m; j += 2) rows_panel_tile<2, V>(c + j, ldc, rows.from(j), panel, np, d, nh, pf);
  for (; j < m; ++j) rows_panel_tile<1, V>(c + j, ldc, rows.from(j), panel, np, d, nh, pf);
}

// c [n, m] (row stride ldc) = P^T . rows^T: c[h * ldc + j] = sum_p rows[j][p] panel[p * np + h]
// for j < m, h < n; panel [d, np] with np >= n a multiple of kLanes (columns past n are read, not
// stored). Heads in chunks of up to 2 vectors (4 spilled the tile's operands out of registers).
template <typename Rows>
inline void rows_times_panel(float* c, int64_t ldc, const Rows& rows, int64_t m, const float* panel, int64_t np,
                             int64_t n, int64_t d, LinePrefetch* pf = nullptr) {
  for (int64_t h0 = 0; h0 < n; h0 += 2 * kLanes) {
    const int64_t nh = std::min<int64_t>(2 * kLanes, n - h0);
    float* ch = c + h0 * ldc;
    if (nh > kLanes)
      rows_panel<2>(ch, ldc, rows, m, panel + h0, np, d, nh, pf);
    else
      rows_panel<1>(ch, ldc, rows, m, panel + h0, np, d, nh, pf);
  }
}

// The transposed, lane-padded panel of a [n, d] (row stride lda): panel[p * np + h] = a[h][p].
inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }
inline void transpose_panel(float* panel, const float* a, int64_t lda, int64_t n, int64_t d) {
  const int64_t np = padded(n);
  for (int64_t p = 0; p < d; ++p)
    for (int64_t h = 0; h < np; ++h) panel[p * np + h] = h < n ? a[h * lda + p] : 0.f;
}

// Rows gathered for the micro-kernels start on a cache line (the row length is a multiple of 16
// floats at GLM-5's shapes): a column chunk of 16 floats is then one line, not two (measured: the
// panel-times-rows kernels went from ~54 to ~65 GFLOP/s a core).
struct LineAligned {
  std::vector<float> storage;
  float* p;
  explicit LineAligned(int64_t size) : storage(size + 16) {
    const auto at = reinterpret_cast<uintptr_t>(storage.data());
    p = storage.data() + ((64 - at % 64) % 64) / sizeof(float);
  }
  float* data() { return p; }
};

// c[h * ldc + i] += sum_j pm[h * ldp + j] rows[j][col + i] for h < H, i < C vectors, j < m.
template <int H, int C, typename Rows>
inline void panel_rows_tile(float* c, int64_t ldc, const float* pm, int64_t ldp, const Rows& rows, int64_t col,
                            int64_t m, LinePrefetch* pf) {
  VecF acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < C; ++v) acc[h][v] = load_vec(c + h * ldc + v * kLanes);
  for (int64_t j = 0; j < m; ++j) {
    if (pf && j % 4 == 0) pf->step();
    VecF w[C];
    const float* row = rows[j] + col;
    for (int v = 0; v < C; ++v) w[v] = load_vec(row + v * kLanes);
    for (int h = 0; h < H; ++h) {
      const VecF x = splat(pm[h * ldp + j]);
      for (int v = 0; v < C; ++v) acc[h][v] += x * w[v];
    }
  }
  for (int h = 0; h < H; ++h)
    for (int v = 0; v < C; ++v) store_vec(c + h * ldc + v * kLanes, acc[h][v]);
}

template <int C, typename Rows>
void panel_rows(float* c, int64_t ldc, const float* pm, int64_t ldp, int64_t n, const Rows& rows, int64_t col,
                int64_t m, LinePrefetch* pf) {
  constexpr int H = kAccRegs / 2;
  int64_t h = 0;
  // full tiles while at least 4 heads would remain (8 heads: 4 + 4, not 6 + a 2-head tile whose 4
  // accumulators cannot cover the FMA latency)
  for (; h + H + 4 <= n || h + H == n; h += H)
    panel_rows_tile<H, C>(c + h * ldc, ldc, pm + h * ldp, ldp, rows, col, m, pf);
  for (; h + 4 <= n; h += 4) panel_rows_tile<4, C>(c + h * ldc, ldc, pm + h * ldp, ldp, rows, col, m, pf);
  for (; h + 2 <= n; h += 2) panel_rows_tile<2, C>(c + h * ldc, ldc, pm + h * ldp, ldp, rows, col, m, pf);
  for (; h < n; ++h) panel_rows_tile<1, C>(c + h * ldc, ldc, pm + h * ldp, ldp, rows, col, m, pf);
}

// c [n, cols] (row stride ldc) += pm [n, m] (row stride ldp) . rows [m, :cols]: columns in chunks
// of 2 vectors (the chunk's rows stay in L1 across head tiles), then 1, then scalar columns.
template <typename Rows>
inline void panel_times_rows(float* c, int64_t ldc, const float* pm, int64_t ldp, int64_t n, const Rows& rows,
                             int64_t m, int64_t cols, LinePrefetch* pf = nullptr) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= cols; i += 2 * kLanes) panel_rows<2>(c + i, ldc, pm, ldp, n, rows, i, m, pf);
  for (; i + kLanes <= cols; i += kLanes) panel_rows<1>(c + i, ldc, pm, ldp, n, rows, i, m, pf);
  for (; i < cols; ++i)
    for (int64_t h = 0; h < n; ++h) {
      float acc = c[h * ldc + i];
      for (int64_t j = 0; j < m; ++j) acc += pm[h * ldp + j] * rows[j][i];
      c[h * ldc + i] = acc;
    }
}

// dst[r][i] += sum_g coef[g * ldk + r] a[g * lda + i] for r < R, i < C vectors, g < G.
template <int R, int C>
inline void scatter_tile(float* const* dst, float* const* later, int64_t i, const float* coef, int64_t ldk,
                         const float* a, int64_t lda, int64_t G) {
  if (later)  // the next tile's rows, the lines of this column chunk
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < C * kLanes; c += 16) __builtin_prefetch(later[r] + i + c, 1);
  VecF acc[R][C] = {};
  for (int64_t g = 0; g < G; ++g) {
    VecF w[C];
    for (int v = 0; v < C; ++v) w[v] = load_vec(a + g * lda + i + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VecF x = splat(coef[g * ldk + r]);
      for (int v = 0; v < C; ++v) acc[r][v] += x * w[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) store_vec(dst[r] + i + v * kLanes, load_vec(dst[r] + i + v * kLanes) + acc[r][v]);
}

template <int R>
inline void scatter_rows(float* const* dst, float* const* later, const float* coef, int64_t ldk, const float* a,
                         int64_t lda, int64_t G, int64_t G_tail, int64_t tail_from, int64_t cols) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= cols; i += 2 * kLanes)
    scatter_tile<R, 2>(dst, later, i, coef, ldk, a, lda, i >= tail_from ? G_tail : G);
  for (; i + kLanes <= cols; i += kLanes)
    scatter_tile<R, 1>(dst, later, i, coef, ldk, a, lda, i >= tail_from ? G_tail : G);
  for (; i < cols; ++i)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < (i >= tail_from ? G_tail : G); ++g) acc += coef[g * ldk + r] * a[g * lda + i];
      dst[r][i] += acc;
    }
}

// out[idx[j]] += sum_g coef[g * ldk + j] a[g] for j < m, the rows of a [G, cols] (row stride lda)
// weighted by coef [G, m] (row stride ldk), added straight into the scattered destination rows of
// out (row stride cols): the [m, cols] product is never written. Columns from tail_from on sum only
// the first G_tail rows of a (the rest are zero there). The next tile's destination rows are
// prefetched for writing a column chunk at a time, spread over this tile's work.
inline void add_product_rows(float* out, const int64_t* idx, int64_t m, const float* coef, int64_t ldk,
                             const float* a, int64_t lda, int64_t G, int64_t G_tail, int64_t tail_from,
                             int64_t cols) {
  constexpr int R = kAccRegs / 2;
  float* dst[R];
  float* later[R];
  int64_t j = 0;
  for (; j + R <= m; j += R) {
    for (int r = 0; r < R; ++r) {
      dst[r] = out + idx[j + r] * cols;
      later[r] = out + idx[std::min(j + R + r, m - 1)] * cols;
    }
    scatter_rows<R>(dst, j + R < m ? later : nullptr, coef + j, ldk, a, lda, G, G_tail, tail_from, cols);
  }
  for (; j < m; ++j) {
    dst[0] = out + idx[j] * cols;
    scatter_rows<1>(dst, nullptr, coef + j, ldk, a, lda, G, G_tail, tail_from, cols);
  }
}

// [b, s, n, d] rows in any layout with contiguous last dim (q's pieces, o and dO are read in
// place; dq's pieces written in place).
template <typename T>
struct Rows {
  T* p;
  int64_t sb, ss, sh;
  static Rows of(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "sparse MLA: q, o, dO and dq need a contiguous last dim");
    return Rows{x.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)};
  }
  T* row(int64_t bi, int64_t si, int64_t h) const { return p + bi * sb + si * ss + h * sh; }
};

// The absorbed query in two pieces, the latent [.., dv] and the rope [.., d - dv] part (the
// caller's absorption GEMM output and its rope slice, never concatenated), read into one row.
template <typename T>
struct QueryRows {
  Rows<T> lat, pe;
  int64_t dv, d;
  void load(float* dst, int64_t bi, int64_t si, int64_t h) const {
    load_row(dst, lat.row(bi, si, h), dv);
    load_row(dst + dv, pe.row(bi, si, h), d - dv);
  }
  void store(const float* src, int64_t bi, int64_t si, int64_t h, float scale) const {
    store_row(lat.row(bi, si, h), src, dv, scale);
    store_row(pe.row(bi, si, h), src + dv, d - dv, scale);
  }
};

struct Dims {
  int64_t b, s, n, d, dv, k, L, block;
};

// Asks pf for the key block after [j0, j0 + block) of query t: the query's next block, or the
// first block of the thread's next query.
template <typename T>
void ask_for_next_block(LinePrefetch& pf, const Dims& z, const T* kv, const int64_t* idx, int64_t t, int64_t j0,
                        int64_t end) {
  int64_t nt = t, nj = j0 + z.block;
  if (nj >= z.k) nt = t + 1, nj = 0;
  if (nt < end)
    pf.ask_for(kv + nt / z.s * z.L * z.d, idx + nt * z.k + nj, std::min(z.block, z.k - nj), z.d, z.L);
  else
    pf.rows = 0;
}

template <typename T>
void forward_queries(const Dims& z, const QueryRows<T>& q, const T* kv, const int64_t* idx, const bool* valid,
                     float scale, T* out, float* lse, float* head_probs, int64_t begin, int64_t end) {
  const int64_t n = z.n, d = z.d, dv = z.dv, k = z.k, B = z.block;
  std::vector<float> qs(n * d), qp(d * padded(n)), scores(n * k), p(n * B), o(n * dv), m(n), l(n),
      hide(k);
  LineAligned buf(std::is_same_v<T, float> ? 0 : B * d);
  std::vector<const float*> at(B);
  LinePrefetch next_block;
  LinePrefetch* pf = LinePrefetch::for_rows_of<T>(next_block);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t bi = t / z.s;
    const T* kv_b = kv + bi * z.L * d;
    const int64_t* ix = idx + t * k;
    const bool* vd = valid ? valid + t * k : nullptr;
    hidden_keys(hide.data(), vd, k);
    for (int64_t h = 0; h < n; ++h) {
      q.load(qs.data() + h * d, bi, t % z.s, h);
      for (int64_t i = 0; i < d; ++i) qs[h * d + i] *= scale;  // the scale goes on q
    }
    transpose_panel(qp.data(), qs.data(), d, n, d);
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.f);
    for (int64_t j0 = 0; j0 < k; j0 += B) {
      const int64_t nb = std::min(B, k - j0);
      const PointedRows rows = select_rows(at.data(), buf.data(), kv_b, ix + j0, nb, k - j0, d, z.L);
      if (pf) ask_for_next_block(*pf, z, kv, idx, t, j0, end);
      // scores[:, j0:j0+nb] = qs [n, d] . rows[nb, d]^T
      rows_times_panel(scores.data() + j0, k, rows, nb, qp.data(), padded(n), n, d, pf);
      for (int64_t h = 0; h < n; ++h) {
        float* sr = scores.data() + h * k + j0;
        if (vd) {
          int64_t j = 0;
          for (; j + kLanes <= nb; j += kLanes) store_vec(sr + j, load_vec(sr + j) + load_vec(hide.data() + j0 + j));
          for (; j < nb; ++j) sr[j] += hide[j0 + j];
        }
        const float mn = std::max(m[h], max_of(sr, nb));
        float* pr = p.data() + h * B;
        if (mn == kNegInf) {  // nothing visible yet for this head
          std::fill(pr, pr + nb, 0.f);
          continue;
        }
        const float corr = exp_nonpositive(m[h] - mn);
        if (corr != 1.f) {
          for (int64_t i = 0; i < dv; ++i) o[h * dv + i] *= corr;
          l[h] *= corr;
        }
        l[h] += static_cast<float>(exp_shifted(pr, sr, nb, mn));
        m[h] = mn;
      }
      // o [n, dv] += p [n, nb] . rows[nb, :dv]
      panel_times_rows(o.data(), dv, p.data(), B, n, rows, nb, dv, pf);
    }
    float* hp = head_probs + t * k;
    std::fill(hp, hp + k, 0.f);
    for (int64_t h = 0; h < n; ++h) {
      const float lh = m[h] + std::log(l[h]);
      lse[t * n + h] = lh;
      store_row(out + (h * z.b * z.s + t) * dv, o.data() + h * dv, dv, 1.f / l[h]);  // head-major
      const float* sr = scores.data() + h * k;
      add_exp_shifted(hp, sr, k, lh);
    }
  }
}

template <typename T>
void backward_queries(const Dims& z, const QueryRows<T>& q, const T* kv, const int64_t* idx, const bool* valid,
                      float scale, const Rows<T>& grad_out, const Rows<T>& out, const float* lse,
                      const QueryRows<T>& grad_q, float* grad_kv, int64_t begin, int64_t end) {
  const int64_t n = z.n, d = z.d, dv = z.dv, k = z.k, B = z.block;
  // a = [q * scale ; dO | 0] (2n rows): t = [dS ; P] against a gives both terms of the kv gradient
  // in one product. qp, dp: a's halves transposed for the scores and dP (dP over the dv latent
  // columns only: dO's row is zero past them).
  std::vector<float> a(2 * n * d, 0.f), qp(d * padded(n)), dp(dv * padded(n)), tb(2 * n * B), dq(n * d), delta(n),
      orow(dv), hide(k);
  LineAligned buf(std::is_same_v<T, float> ? 0 : B * d);
  std::vector<const float*> at(B);
  LinePrefetch next_block;
  LinePrefetch* pf = LinePrefetch::for_rows_of<T>(next_block);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t bi = t / z.s;
    const T* kv_b = kv + bi * z.L * d;
    float* gkv_b = grad_kv + bi * z.L * d;
    const int64_t* ix = idx + t * k;
    const bool* vd = valid ? valid + t * k : nullptr;
    hidden_keys(hide.data(), vd, k);
    for (int64_t h = 0; h < n; ++h) {
      float* qa = a.data() + h * d;
      float* da = a.data() + (n + h) * d;
      q.load(qa, bi, t % z.s, h);
      for (int64_t i = 0; i < d; ++i) qa[i] *= scale;
      load_row(da, grad_out.row(bi, t % z.s, h), dv);
      load_row(orow.data(), out.row(bi, t % z.s, h), dv);
      float acc = 0.f;  // delta = rowsum(dO * O)
      for (int64_t i = 0; i < dv; ++i) acc += da[i] * orow[i];
      delta[h] = acc;
    }
    transpose_panel(qp.data(), a.data(), d, n, d);
    transpose_panel(dp.data(), a.data() + n * d, d, n, dv);
    std::fill(dq.begin(), dq.end(), 0.f);
    for (int64_t j0 = 0; j0 < k; j0 += B) {
      const int64_t nb = std::min(B, k - j0);
      const PointedRows rows = select_rows(at.data(), buf.data(), kv_b, ix + j0, nb, k - j0, d, z.L);
      if (pf) ask_for_next_block(*pf, z, kv, idx, t, j0, end);
      rows_times_panel(tb.data(), B, rows, nb, qp.data(), padded(n), n, d, pf);
      rows_times_panel(tb.data() + n * B, B, rows, nb, dp.data(), padded(n), n, dv, pf);
      for (int64_t h = 0; h < n; ++h) {
        float* s_ds = tb.data() + h * B;        // scores -> dS / scale
        float* dp_p = tb.data() + (n + h) * B;  // dP -> P
        const float lh = lse[t * n + h], dh = delta[h];
        const float* hb = hide.data() + j0;  // hidden keys: exp(-inf) = 0
        int64_t j = 0;
        for (; j + kLanes <= nb; j += kLanes) {
          const VecF pj = exp_nonpositive(load_vec(s_ds + j) - lh + load_vec(hb + j));
          store_vec(s_ds + j, pj * (load_vec(dp_p + j) - dh));
          store_vec(dp_p + j, pj);
        }
        for (; j < nb; ++j) {
          const float pj = exp_nonpositive(s_ds[j] - lh + hb[j]);
          s_ds[j] = pj * (dp_p[j] - dh);
          dp_p[j] = pj;
        }
      }
      // dq [n, d] += dS [n, nb] . rows [nb, d]
      panel_times_rows(dq.data(), d, tb.data(), B, n, rows, nb, d, pf);
      // dkv rows [nb, d] += [dS ; P]^T [nb, 2n] . a [2n, d], added in place (dO is zero past dv)
      add_product_rows(gkv_b, ix + j0, nb, tb.data(), B, a.data(), d, 2 * n, n, dv, d);
    }
    for (int64_t h = 0; h < n; ++h) grad_q.store(dq.data() + h * d, bi, t % z.s, h, scale);
  }
}

// q = [q_lat | q_pe] (the latent and rope pieces, [b, s, n, dv] and [b, s, n, d - dv]).
Dims dims_of(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv, const at::Tensor& idx,
             const c10::optional<at::Tensor>& valid, int64_t block) {
  TORCH_CHECK(!valid || (valid->scalar_type() == at::kBool && valid->sizes() == idx.sizes()),
              "sparse MLA: valid must be a bool tensor shaped like idx ", idx.sizes());
  TORCH_CHECK(q_lat.dim() == 4 && q_pe.dim() == 4 && kv.dim() == 3 && idx.dim() == 3,
              "sparse MLA: q_lat [b, s, n, dv], q_pe [b, s, n, D - dv], kv [b, L, D], idx [b, s, k]");
  TORCH_CHECK(kv.is_contiguous() && idx.is_contiguous(), "sparse MLA: contiguous kv and idx");
  TORCH_CHECK(idx.scalar_type() == at::kLong, "sparse MLA: int64 indices");
  TORCH_CHECK(q_lat.scalar_type() != at::kDouble, "sparse MLA (CPU kernel): fp32/bf16/fp16 only");
  const int64_t d = q_lat.size(3) + q_pe.size(3);
  TORCH_CHECK(kv.scalar_type() == q_lat.scalar_type() && q_pe.scalar_type() == q_lat.scalar_type() &&
                  q_pe.sizes().slice(0, 3) == q_lat.sizes().slice(0, 3) && kv.size(0) == q_lat.size(0) &&
                  kv.size(2) == d && idx.size(0) == q_lat.size(0) && idx.size(1) == q_lat.size(1),
              "sparse MLA: q_lat ", q_lat.sizes(), ", q_pe ", q_pe.sizes(), ", kv ", kv.sizes(), " and idx ",
              idx.sizes(), " disagree");
  return Dims{q_lat.size(0), q_lat.size(1), q_lat.size(2), d, q_lat.size(3), idx.size(2), kv.size(1), block};
}

template <typename T>
QueryRows<T> query_rows(const at::Tensor& lat, const at::Tensor& pe, const Dims& z) {
  return QueryRows<T>{Rows<T>::of(lat), Rows<T>::of(pe), z.dv, z.d};
}

// fn(t) for t in [0, threads) on the calling thread's OpenMP team, exceptions rethrown here.
// Not at::parallel_for: its inline first-use initialisation is this library's own copy, so on
// its first call in a thread it re-applies torch's process-wide thread count to that thread,
// which the CPU emulation sets to 1 for helper threads: the training thread would drop to one
// thread for the rest of the process.
template <typename F>
void on_threads(int64_t threads, const F& fn) {
  std::exception_ptr error;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int64_t t = 0; t < threads; ++t) {
    try {
      fn(t);
    } catch (...) {
#pragma omp critical
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Threads for `rows` independent rows: torch's intra-op count, no more than there are rows.
int64_t row_threads(int64_t rows) { return std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(rows, 1)); }

// Query ranges per thread: fixed by the thread count, so the kv-gradient sum order is too.
std::vector<int64_t> split(int64_t total, int64_t parts) {
  std::vector<int64_t> edges(parts + 1);
  for (int64_t i = 0; i <= parts; ++i) edges[i] = total * i / parts;
  return edges;
}

// The valid mask's data (nullptr: every key visible); `keep` holds a contiguous copy if needed.
const bool* valid_data(const c10::optional<at::Tensor>& valid, at::Tensor& keep) {
  if (!valid) return nullptr;
  keep = valid->contiguous();
  return keep.data_ptr<bool>();
}

// Gradient rows added by several threads: one zeroed fp32 [b, L, d] buffer per thread (at most 8,
// so the memory stays bounded on big hosts), summed in thread order afterwards (deterministic for
// a given thread count).
struct PerThreadRows {
  int64_t threads, size;
  at::Tensor buffers;
  PerThreadRows(int64_t b, int64_t L, int64_t d, const at::TensorOptions& opts)
      : threads(std::min<int64_t>(at::get_num_threads(), 8)), size(b * L * d),
        buffers(at::zeros({threads, b, L, d}, opts.dtype(at::kFloat))) {}
  float* of(int64_t t) { return buffers.data_ptr<float>() + t * size; }
  at::Tensor sum() const { return threads == 1 ? buffers[0] : buffers.sum(0); }
};

std::vector<at::Tensor> forward(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv,
                                const at::Tensor& idx, const c10::optional<at::Tensor>& valid, double scale,
                                int64_t block) {
  const Dims z = dims_of(q_lat, q_pe, kv, idx, valid, block);
  // o is written head-major ([n, b, s, dv], returned as a [b, s, n, dv] view): the W_UV
  // projection's per-head GEMM then reads it in place instead of a permuted copy
  auto opts = q_lat.options();
  auto out = at::empty({z.n, z.b, z.s, z.dv}, opts);
  auto lse = at::empty({z.b, z.s, z.n}, opts.dtype(at::kFloat));
  auto head_probs = at::empty({z.b, z.s, z.k}, opts.dtype(at::kFloat));
  at::Tensor valid_keep;
  const bool* vd = valid_data(valid, valid_keep);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_lat.scalar_type(), "sparse_mla_cpu_forward", [&] {
    const int64_t threads = at::get_num_threads();
    const auto edges = split(z.b * z.s, threads);
    const auto q = query_rows<scalar_t>(q_lat, q_pe, z);
    on_threads(threads, [&](int64_t t) {
      forward_queries<scalar_t>(z, q, kv.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), vd,
                                static_cast<float>(scale), out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                                head_probs.data_ptr<float>(), edges[t], edges[t + 1]);
    });
  });
  return {out.permute({1, 2, 0, 3}), lse, head_probs};
}

// (d q_lat, d q_pe, d kv). d q_lat is head-major like o (the absorption's per-head GEMM reads its
// gradient in place).
std::vector<at::Tensor> backward(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& kv,
                                 const at::Tensor& idx, const c10::optional<at::Tensor>& valid, double scale,
                                 int64_t block, const at::Tensor& grad_out, const at::Tensor& out,
                                 const at::Tensor& lse) {
  const Dims z = dims_of(q_lat, q_pe, kv, idx, valid, block);
  auto grad_lat = at::empty({z.n, z.b, z.s, z.dv}, q_lat.options()).permute({1, 2, 0, 3});
  auto grad_pe = at::empty({z.b, z.s, z.n, z.d - z.dv}, q_pe.options());
  at::Tensor valid_keep;
  const bool* vd = valid_data(valid, valid_keep);
  PerThreadRows grad_kv(z.b, z.L, z.d, q_lat.options());
  const auto edges = split(z.b * z.s, grad_kv.threads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_lat.scalar_type(), "sparse_mla_cpu_backward", [&] {
    const auto go = Rows<scalar_t>::of(grad_out), o = Rows<scalar_t>::of(out);
    const auto q = query_rows<scalar_t>(q_lat, q_pe, z), dq = query_rows<scalar_t>(grad_lat, grad_pe, z);
    on_threads(grad_kv.threads, [&](int64_t t) {
      backward_queries<scalar_t>(z, q, kv.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), vd,
                                 static_cast<float>(scale), go, o, lse.data_ptr<float>(), dq, grad_kv.of(t),
                                 edges[t], edges[t + 1]);
    });
  });
  return {grad_lat, grad_pe, grad_kv.sum().to(kv.scalar_type())};
}

// One query's indexer KL over its n candidate keys from the per-head scores ph [H, n] (row stride
// ld): weighted-ReLU logits, log-softmax (log-sum-exp in double: a float running sum over
// thousands of keys is off by ~1e-7 relative, which the KL near convergence shows), KL(target ||
// softmax) summed in double. With grads, dw[H] and ph overwritten by d KL / d ph. hidden(j): key j
// is masked (target 0 there). logits and dlog: scratch of n floats.
template <typename Hidden>
double kl_row(float* ph, int64_t ld, int64_t H, int64_t n, const float* w, const float* target, const Hidden& hidden,
              bool want_grads, float* dw, float* logits, float* dlog) {
  std::fill(logits, logits + n, 0.f);
  for (int64_t h = 0; h < H; ++h) {  // written with vectors: GCC keeps a select loop scalar
    float* r = ph + h * ld;
    const float wh = w[h];
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const VecF x = load_vec(r + j), relu = x > 0.f ? x : VecF{};
      store_vec(r + j, relu);
      store_vec(logits + j, load_vec(logits + j) + wh * relu);
    }
    for (; j < n; ++j) {
      r[j] = std::max(r[j], 0.f);
      logits[j] += wh * r[j];
    }
  }
  for (int64_t j = 0; j < n; ++j)
    if (hidden(j)) logits[j] = kNegInf;  // from here on -inf marks a hidden key (target 0 there)
  const float m = max_of(logits, n);
  const float log_sum = static_cast<float>(std::log(exp_shifted(dlog, logits, n, m)));
  // sum t log q (log_softmax takes z - max first; t = 0 at hidden keys), and d logits = softmax -
  // target (0 - 0 at hidden keys), the softmax formed as exp(z - max - lse)
  VecD cross_lanes = VecD{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VecF logq = (load_vec(logits + j) - m) - log_sum, t = load_vec(target + j);
    cross_lanes += __builtin_convertvector(t > 0.f ? t * logq : VecF{}, VecD);
    store_vec(dlog + j, exp_nonpositive(logq) - t);
  }
  double cross = 0.0;
  for (int64_t i = 0; i < kLanes; ++i) cross += cross_lanes[i];
  for (; j < n; ++j) {
    const float logq = (logits[j] - m) - log_sum;
    if (target[j] > 0.f) cross += static_cast<double>(target[j] * logq);
    dlog[j] = exp_nonpositive(logq) - target[j];
  }
  double entropy = 0.0;  // sum t log t
  for (j = 0; j < n; ++j)
    if (target[j] > 0.f) entropy += static_cast<double>(target[j] * std::log(target[j]));
  if (!want_grads) return entropy - cross;
  for (int64_t h = 0; h < H; ++h) {  // dw, then d per_head = [relu > 0] w dlogits (in place)
    float* r = ph + h * ld;
    dw[h] = dot(r, dlog, n);
    const float wh = w[h];
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes)
      store_vec(r + j, load_vec(r + j) > 0.f ? wh * load_vec(dlog + j) : VecF{});
    for (; j < n; ++j) r[j] = r[j] > 0.f ? wh * dlog[j] : 0.f;
  }
  return entropy - cross;
}

// ---- The indexer's sparse KL (dsa/kl.py, sparse form) with its gradients, per query: ----
// the query's selected indexer keys in blocks (GEMM per head), weighted-ReLU logits over all k,
// log-softmax, KL(target || softmax), then d logits = softmax - target back through the ReLU into
// dq, dw and the key rows (added into per-thread fp32 buffers, summed in thread order). fp32
// inputs; the value is summed per row first, rows in double.
void kl_queries(const Dims& z, int64_t heads, const float* q, const float* keys, const float* w,
                const int64_t* idx, const bool* valid, const float* target, bool want_grads, double* value,
                float* dq, float* dk, float* dw, int64_t begin, int64_t end) {
  const int64_t H = heads, d = z.d, k = z.k;
  // all k selected key rows (k x d x 4 B: 1 MiB for GLM-5's 2048 x 128) gathered once per query,
  // for the scores and again for dq: a second gather from the whole sequence cost more than the GEMMs
  LineAligned rows(k * d);
  std::vector<float> qp(d * padded(H)), ph(H * k), logits(k), dlog(k);
  double total = 0.0;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t bi = t / z.s;
    const int64_t* ix = idx + t * k;
    const bool* vd = valid ? valid + t * k : nullptr;
    const float* qt = q + t * H * d;
    gather_rows(rows.data(), keys + bi * z.L * d, ix, k, k, d, z.L);
    transpose_panel(qp.data(), qt, d, H, d);
    rows_times_panel(ph.data(), k, StridedRows{rows.data(), d}, k, qp.data(), padded(H), H, d);  // per-head scores [H, k]
    total += kl_row(ph.data(), k, H, k, w + t * H, target + t * k, [vd](int64_t j) { return vd && !vd[j]; },
                    want_grads, want_grads ? dw + t * H : nullptr, logits.data(), dlog.data());
    if (!want_grads) continue;
    std::fill(dq + t * H * d, dq + (t + 1) * H * d, 0.f);
    panel_times_rows(dq + t * H * d, d, ph.data(), k, H, StridedRows{rows.data(), d}, k, d);  // dq = dph . K
    float* dk_b = dk + bi * z.L * d;
    add_product_rows(dk_b, ix, k, ph.data(), k, qt, d, H, H, d, d);  // dk rows += dph^T . q
  }
  *value = total;
}

// (sum over queries of the KL, dq [b, s, H, d], dk [b, L, d], dw [b, s, H]) in fp32; the
// gradients are empty tensors when want_grads is false.
std::vector<at::Tensor> sparse_kl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& w,
                                  const at::Tensor& idx, const c10::optional<at::Tensor>& valid,
                                  const at::Tensor& target, bool want_grads) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 3 && w.dim() == 3 && idx.dim() == 3, "indexer KL: q [b, s, H, d], "
              "keys [b, L, d], w [b, s, H], idx [b, s, k]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  target.scalar_type() == at::kFloat, "indexer KL (CPU kernel): fp32 inputs");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && w.is_contiguous() && idx.is_contiguous() &&
                  target.is_contiguous() && target.sizes() == idx.sizes() && idx.scalar_type() == at::kLong &&
                  keys.size(2) == q.size(3) && w.size(2) == q.size(2),
              "indexer KL: contiguous inputs, target shaped like idx (int64), matching dims");
  TORCH_CHECK(!valid || (valid->scalar_type() == at::kBool && valid->sizes() == idx.sizes()),
              "indexer KL: valid must be a bool tensor shaped like idx");
  const Dims z{q.size(0), q.size(1), q.size(2), q.size(3), 0, idx.size(2), keys.size(1), 0};
  const int64_t H = q.size(2);
  at::Tensor valid_keep;
  const bool* vd = valid_data(valid, valid_keep);
  auto opts = q.options();
  auto dq = want_grads ? at::empty_like(q) : at::empty({0}, opts);
  auto dw = want_grads ? at::empty_like(w) : at::empty({0}, opts);
  PerThreadRows dk(z.b, want_grads ? z.L : 0, z.d, opts);  // no rows without gradients
  const auto edges = split(z.b * z.s, dk.threads);
  std::vector<double> values(dk.threads, 0.0);
  on_threads(dk.threads, [&](int64_t t) {
    kl_queries(z, H, q.data_ptr<float>(), keys.data_ptr<float>(), w.data_ptr<float>(), idx.data_ptr<int64_t>(), vd,
               target.data_ptr<float>(), want_grads, &values[t], want_grads ? dq.data_ptr<float>() : nullptr,
               want_grads ? dk.of(t) : nullptr, want_grads ? dw.data_ptr<float>() : nullptr, edges[t],
               edges[t + 1]);
  });
  double total = 0.0;
  for (double v : values) total += v;
  return {at::scalar_tensor(total, opts), dq, dk.sum(), dw};
}

// ---- The indexer's dense KL (dsa/kl.py, dense form), a chunk of query rows at a time: ----
// the elementwise work between the chunk's GEMMs (which stay torch's), one row at a time while
// the row is in L2. Op by op, each step (mask, max, exp, sum, divide, head sum; ReLU, logits,
// softmax, gradients) is a pass over n x c x keys scores in memory at long context.

// The mask of row r (hidden [hb, c, keys], hb = 1 or b; none: nothing hidden) from column
// first_hidden on (no key before it is hidden from any row of the chunk).
struct HiddenRows {
  const bool* p;
  int64_t hb, c, keys, first;
  const bool* row(int64_t bi, int64_t r) const { return p ? p + ((hb == 1 ? 0 : bi) * c + r) * keys : nullptr; }
};

HiddenRows hidden_rows(const c10::optional<at::Tensor>& hidden, at::Tensor& keep, int64_t b, int64_t c, int64_t keys,
                       int64_t first_hidden) {
  if (!hidden) return HiddenRows{nullptr, 1, c, keys, keys};
  TORCH_CHECK(hidden->scalar_type() == at::kBool && hidden->dim() == 3 && (hidden->size(0) == 1 || hidden->size(0) == b) &&
                  hidden->size(1) == c && hidden->size(2) == keys,
              "dense KL: hidden must be bool [1 or ", b, ", ", c, ", ", keys, "], got ", hidden->sizes());
  keep = hidden->contiguous();
  return HiddenRows{keep.data_ptr<bool>(), keep.size(0), c, keys, std::max<int64_t>(first_hidden, 0)};
}

// scores [b, n, c, keys] fp32 (the chunk's main-attention scores, scaled; overwritten) -> the
// per-head softmax over the visible keys summed over the heads [b, c, keys] fp32 (not yet
// normalised over the TP group's heads). Sums in double.
at::Tensor attention_target(at::Tensor scores, const c10::optional<at::Tensor>& hidden, int64_t first_hidden) {
  TORCH_CHECK(scores.dim() == 4 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "attention target: contiguous fp32 scores [b, n, c, keys]");
  const int64_t b = scores.size(0), n = scores.size(1), c = scores.size(2), keys = scores.size(3);
  at::Tensor keep;
  const HiddenRows hid = hidden_rows(hidden, keep, b, c, keys, first_hidden);
  auto probs = at::empty({b, c, keys}, scores.options());
  float* sp = scores.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  const int64_t threads = row_threads(b * c);
  const auto edges = split(b * c, threads);
  on_threads(threads, [&](int64_t t) {
    for (int64_t row = edges[t]; row < edges[t + 1]; ++row) {
      const int64_t bi = row / c, r = row % c;
      const bool* hr = hid.row(bi, r);
      float* acc = pp + row * keys;
      std::fill(acc, acc + keys, 0.f);
      for (int64_t h = 0; h < n; ++h) {
        float* x = sp + ((bi * n + h) * c + r) * keys;
        if (hr)
          for (int64_t j = hid.first; j < keys; ++j)
            if (hr[j]) x[j] = kNegInf;
        const float m = max_of(x, keys);
        if (m == kNegInf) continue;  // nothing visible: no probability mass
        const float inv = static_cast<float>(1.0 / exp_shifted(x, x, keys, m));
        for (int64_t j = 0; j < keys; ++j) acc[j] += x[j] * inv;
      }
    }
  });
  return probs;
}

// per_head [R, H, keys] fp32 (the chunk's indexer scores q . k per head, rows = batch x c; overwritten
// with the KL's gradient w.r.t. them when want_grads), w [R, H], target [R, keys] (0 at hidden keys),
// hidden as in attention_target -> (sum over rows of the KL (summed in double), d w [R, H] (empty
// without grads)).
std::vector<at::Tensor> dense_kl_rows(at::Tensor per_head, const at::Tensor& w, const at::Tensor& target,
                                      const c10::optional<at::Tensor>& hidden, int64_t batch, int64_t first_hidden,
                                      bool want_grads) {
  TORCH_CHECK(per_head.dim() == 3 && per_head.scalar_type() == at::kFloat && per_head.is_contiguous() &&
                  w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 2 &&
                  w.size(0) == per_head.size(0) && w.size(1) == per_head.size(1) &&
                  target.scalar_type() == at::kFloat && target.is_contiguous() && target.dim() == 2 &&
                  target.size(0) == per_head.size(0) && target.size(1) == per_head.size(2),
              "dense KL: contiguous fp32 per_head [R, H, keys], w [R, H], target [R, keys]");
  const int64_t R = per_head.size(0), H = per_head.size(1), keys = per_head.size(2);
  TORCH_CHECK(batch >= 1 && R % batch == 0, "dense KL: ", R, " rows are not ", batch, " samples' chunks");
  at::Tensor keep;
  const HiddenRows hid = hidden_rows(hidden, keep, batch, R / batch, keys, first_hidden);
  auto dw = want_grads ? at::empty({R, H}, w.options()) : at::empty({0}, w.options());
  float* ph = per_head.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* tp = target.data_ptr<float>();
  float* dwp = want_grads ? dw.data_ptr<float>() : nullptr;
  const int64_t threads = row_threads(R);
  const auto edges = split(R, threads);
  std::vector<double> values(threads, 0.0);
  on_threads(threads, [&](int64_t t) {
    std::vector<float> logits(keys), dlog(keys);
    for (int64_t row = edges[t]; row < edges[t + 1]; ++row) {
      const bool* hr = hid.row(row / hid.c, row % hid.c);
      const int64_t first = hid.first;
      values[t] += kl_row(ph + row * H * keys, keys, H, keys, wp + row * H, tp + row * keys,
                          [hr, first](int64_t j) { return hr && j >= first && hr[j]; }, want_grads,
                          want_grads ? dwp + row * H : nullptr, logits.data(), dlog.data());
    }
  });
  double total = 0.0;
  for (double v : values) total += v;
  return {at::scalar_tensor(total, w.options()), dw};
}

// ---- The indexer's deterministic top-k (dsa/topk.py's rule) per row, by radix select: ----
// scores -> unsigned keys of the same order (NaN as -inf, -0.0 as +0.0); the k-th largest key by
// 11/11/10-bit histograms (the first over the row, the others over the candidates left); then
// one pass in position order takes every key above it and the first ties, so the indices come
// out ascending and equal scores go lowest position first.
inline uint32_t order_key(float x) {
  if (std::isnan(x)) x = kNegInf;
  if (x == 0.f) x = 0.f;  // -0.0 ties +0.0
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k-th largest of keys[0..n) (1 <= k <= n); keys is reordered.
uint32_t kth_largest(std::vector<uint32_t>& keys, int64_t n, int64_t k) {
  uint32_t prefix = 0, prefix_mask = 0;
  std::vector<int64_t> hist;
  for (int shift : {21, 10, 0}) {
    const int bits = shift == 0 ? 10 : 11;
    hist.assign(int64_t{1} << bits, 0);
    const uint32_t digit_mask = (1u << bits) - 1;
    for (int64_t i = 0; i < n; ++i) ++hist[(keys[i] >> shift) & digit_mask];
    int64_t digit = digit_mask, above = 0;
    while (above + hist[digit] < k) above += hist[digit--];
    k -= above;  // rank within the chosen bucket
    prefix |= static_cast<uint32_t>(digit) << shift;
    prefix_mask |= digit_mask << shift;
    int64_t m = 0;  // keep the bucket's keys only
    for (int64_t i = 0; i < n; ++i)
      if ((keys[i] & prefix_mask) == prefix) keys[m++] = keys[i];
    n = m;
  }
  return prefix;
}

at::Tensor topk(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.dim() >= 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "top-k (CPU kernel): contiguous fp32 scores [..., L]");
  const int64_t n = scores.size(-1), rows = n ? scores.numel() / n : 0;
  TORCH_CHECK(k >= 1 && k <= n, "top-k: k = ", k, " outside [1, ", n, "]");
  auto sizes = scores.sizes().vec();
  sizes.back() = k;
  auto idx = at::empty(sizes, scores.options().dtype(at::kLong));
  const float* src = scores.data_ptr<float>();
  int64_t* dst = idx.data_ptr<int64_t>();
  const int64_t threads = row_threads(rows);
  const auto edges = split(rows, threads);
  on_threads(threads, [&](int64_t t) {
    std::vector<uint32_t> keys(n), scratch(n);
    for (int64_t r = edges[t]; r < edges[t + 1]; ++r) {
      const float* row = src + r * n;
      for (int64_t i = 0; i < n; ++i) keys[i] = scratch[i] = order_key(row[i]);
      const uint32_t kth = kth_largest(scratch, n, k);
      int64_t ties = k;  // keys equal to the k-th largest still to take
      for (int64_t i = 0; i < n; ++i) ties -= keys[i] > kth;
      int64_t* out = dst + r * k;
      for (int64_t i = 0; i < n; ++i)
        if (keys[i] > kth || (keys[i] == kth && ties-- > 0)) *out++ = i;
    }
  });
  return idx;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "sparse MLA forward (CPU)");
  m.def("backward", &backward, "sparse MLA backward (CPU)");
  m.def("sparse_kl", &sparse_kl, "the indexer's sparse KL and its gradients (CPU)");
  m.def("attention_target", &attention_target, "the dense KL's target for a chunk of rows (CPU)");
  m.def("dense_kl_rows", &dense_kl_rows, "the dense KL and its gradients for a chunk of rows (CPU)");
  m.def("topk", &topk, "deterministic top-k indices per row, ascending (CPU)");
  m.attr("vector_lanes") = kLanes;
}
