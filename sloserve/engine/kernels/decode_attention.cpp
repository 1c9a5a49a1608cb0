// Decode attention straight from the paged KV cache: one query row per sequence against its
// cached positions. A vector loop for every dtype and CPU, and for bf16 caches the AMX tiles
// where the CPU has them.
#include "kernels.h"

#include "common.h"

namespace sloserve {
namespace {

// ---------------------------------------------------------------- decode attention

// The rows of a sequence sit in blocks scattered over the pool, so the hardware prefetcher
// loses the stream at every block boundary and the loop waits on memory: measured on a 2-core
// EPYC, prefetching the row PREFETCH_AHEAD positions ahead made a 200-sequence step's
// attention 2-3x faster (fp32 5.0 -> 1.9 ms, bf16 2.9 -> 1.7 ms per layer).
constexpr int64_t PREFETCH_AHEAD = 8;

// A cached row (all KV heads of a position) holds per head `hd` values, or for the int8 cache
// `hd` int8 values followed by their float32 scale's 4 bytes (engine/model.py KVCache).
template <typename cache_t>
constexpr int64_t row_extra() {
  return 0;
}
template <>
constexpr int64_t row_extra<int8_t>() {
  return 4;
}

// Heads [h0, h0 + heads) of one cached position, as floats into row[heads * hd].
template <typename cache_t>
inline void load_heads(const cache_t* p, int64_t heads, int64_t hd, float* row) {
  const int64_t width = heads * hd;
#pragma omp simd
  for (int64_t x = 0; x < width; ++x) row[x] = load(p[x]);
}

template <>
inline void load_heads(const int8_t* p, int64_t heads, int64_t hd, float* row) {
  for (int64_t h = 0; h < heads; ++h) {
    const int8_t* v = p + h * (hd + 4);
    float scale;
    std::memcpy(&scale, v + hd, sizeof scale);
    float* r = row + h * hd;
#pragma omp simd
    for (int64_t x = 0; x < hd; ++x) r[x] = static_cast<float>(v[x]) * scale;
  }
}

template <typename cache_t>
inline void prefetch_row(const cache_t* base, const int64_t* table, int64_t j, int64_t ctx, int64_t block_size,
                         int64_t nkv, int64_t h0, int64_t stride, int64_t width) {
  const int64_t ahead = j + PREFETCH_AHEAD;
  if (ahead >= ctx) return;
  const char* row = reinterpret_cast<const char*>(
      base + ((table[ahead / block_size] * block_size + ahead % block_size) * nkv + h0) * stride);
  for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(cache_t)); b += 64) __builtin_prefetch(row + b);
}

template <typename scalar_t, typename cache_t, int HD>
void attend(const float* qf, const cache_t* kp, const cache_t* vp, const int64_t* table, int64_t first,
            int64_t ctx, int64_t nkv, int64_t h0, int64_t h1, int64_t group, int64_t hd_dyn, int64_t block_size,
            float scale, float* scores, float* row, float* acc, scalar_t* out) {
  const int64_t hd = HD > 0 ? HD : hd_dyn;
  const int64_t stride = hd + row_extra<cache_t>();  // cache elements per KV head and position
  const int64_t n = ctx - first;
  const int64_t kv_heads = h1 - h0;
  const int64_t width = kv_heads * stride;  // the part of a cached row this task reads
  const int64_t heads = kv_heads * group;  // query heads, in order: [h0 * group, h1 * group)
  for (int64_t j = first; j < ctx; ++j) {
    const cache_t* k = kp + ((table[j / block_size] * block_size + j % block_size) * nkv + h0) * stride;
    prefetch_row(kp, table, j, ctx, block_size, nkv, h0, stride, width);
    load_heads(k, kv_heads, hd, row);
    for (int64_t qh = 0; qh < heads; ++qh) {
      const float* qv = qf + qh * hd;
      const float* kv = row + (qh / group) * hd;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t x = 0; x < hd; ++x) s += qv[x] * kv[x];
      scores[qh * n + (j - first)] = s * scale;
    }
  }
  for (int64_t qh = 0; qh < heads; ++qh) {
    float* s = scores + qh * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = fast_exp(s[j] - mx);
      sum += s[j];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  std::fill(acc, acc + heads * hd, 0.f);
  for (int64_t j = first; j < ctx; ++j) {
    const cache_t* v = vp + ((table[j / block_size] * block_size + j % block_size) * nkv + h0) * stride;
    prefetch_row(vp, table, j, ctx, block_size, nkv, h0, stride, width);
    load_heads(v, kv_heads, hd, row);
    for (int64_t qh = 0; qh < heads; ++qh) {
      const float p = scores[qh * n + (j - first)];
      const float* vv = row + (qh / group) * hd;
      float* o = acc + qh * hd;
#pragma omp simd
      for (int64_t x = 0; x < hd; ++x) o[x] += p * vv[x];
    }
  }
  for (int64_t x = 0; x < heads * hd; ++x) out[x] = store<scalar_t>(acc[x]);
}

#ifdef SLOSERVE_AMX
// ---------------------------------------------------------------- decode attention on AMX tiles
//
// For a bf16 cache on a CPU with AMX (Intel Sapphire Rapids and later). The loop above spends
// ~250 instructions per cached position (a horizontal sum per query head, a float conversion
// per value) and reached 12 GB/s on a 2-vCPU Xeon that reads 50: it was compute-bound. Here the
// tile unit does the products: per 16 positions, QK^T is one tile load and one tile product per
// 32 dimensions of the KV row, and PV one product per 16 output dimensions. Each task reads a
// chunk of KV heads whose query heads fit a tile's 16 rows.
//   1. scores[16 positions][16 heads] = K tile [16 positions][32 dims] x Q^T, where Q^T holds
//      (pair-interleaved, as the tile unit wants) the chunk's query heads, zero where a head's
//      KV head does not own the dimension;
//   2. softmax down each column (a head), vectorized across heads;
//   3. out[16 heads][64 dims] += P [16 heads][16 positions] (bf16) x V [16 positions][64 dims]
//      (pair-interleaved into a scratch tile on the way).
// P is rounded to bf16 for the product, as flash attention does on GPUs; the sum normalizing it
// stays float32.

// Tiles 0-3 accumulate (scores, then four 16-dim column groups of the output). GCC's tile
// intrinsics paste the tile number into the assembly, so these must be literal macros.
#define T_P 4
#define T_V 5
#define T_K 6
#define T_Q 7

void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;  // 16 float32
  }
  c.rows[T_P] = 16, c.colsb[T_P] = 32;  // [16 heads][16 positions] bf16
  c.rows[T_V] = 8, c.colsb[T_V] = 64;   // [8 position pairs][16 dims x 2] bf16
  c.rows[T_K] = 16, c.colsb[T_K] = 64;  // [16 positions][32 dims] bf16
  c.rows[T_Q] = 16, c.colsb[T_Q] = 64;  // [16 dim pairs][16 heads x 2] bf16
  // GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes of the config,
  // which let it move the stores above after the load: a barrier keeps them before.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
}

struct AmxScratch {
  std::vector<uint16_t> qt;      // Q^T tiles, one per 32 dims of the chunk: [16][32]
  std::vector<float, AlignedAllocator<float>> scores;   // [tiles][16 positions][16 heads], then P
  std::vector<uint16_t, AlignedAllocator<uint16_t>> pt;  // P per tile, transposed: [16 heads][16 positions] bf16
  alignas(64) uint16_t vt[8 * 128];  // V of one tile, 64 dims, position pairs interleaved: [8][64 x 2]
  alignas(64) float acc[16 * 64];    // the four accumulators stored: [16 heads][64 dims]
};


// Rows r and r+1 (64 bf16 each, nullptr = zeros) interleaved element by element into dst[128].
inline void interleave_pair(const uint16_t* a, const uint16_t* b, uint16_t* dst) {
  interleave32(a, b, dst);
  interleave32(a ? a + 32 : nullptr, b ? b + 32 : nullptr, dst + 64);
}

// The next tile sits in another block somewhere in the pool: ask for its rows while this one
// computes (measured over a 2 GB pool on the 2-vCPU Xeon: ~5% faster than the hardware's own).
inline void prefetch_tile(const c10::BFloat16* rows, int64_t row_bytes, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t r = 0; r < TILE; ++r)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + r * row_bytes + b, _MM_HINT_T0);
}

// One sequence, KV heads [c0, c0 + kvc) whose nq = kvc * group query heads (<= 16) are q[nq][hd].
void attend_amx(const c10::BFloat16* q, const c10::BFloat16* kp, const c10::BFloat16* vp, const int64_t* table,
                int64_t first, int64_t ctx, int64_t nkv, int64_t c0, int64_t kvc, int64_t group, int64_t hd,
                int64_t block_size, float scale, AmxScratch& s, c10::BFloat16* out) {
  const int64_t nq = kvc * group, width = kvc * hd;  // query heads; KV row elements this task reads
  const int64_t row_bytes = nkv * hd * 2;             // the stride between cached positions
  const int64_t p0 = first / TILE * TILE;             // the first tile's first position
  const int64_t tiles = (ctx - p0 + TILE - 1) / TILE;
  auto slot_ptr = [&](const c10::BFloat16* base, int64_t pos) {
    return base + ((table[pos / block_size] * block_size + pos % block_size) * nkv + c0) * hd;
  };

  // Q^T tiles: qt[t][i][2n + e] = q[n][dim 32t + 2i + e] where head n's KV head owns that dim.
  const int64_t dim_tiles = width / 32;
  s.qt.assign(dim_tiles * 512, 0);
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
  for (int64_t n = 0; n < nq; ++n) {
    const int64_t kv = n / group;
    for (int64_t x = 0; x < hd; ++x) {
      const int64_t dim = kv * hd + x;
      s.qt[(dim / 32) * 512 + ((dim % 32) / 2) * 32 + 2 * n + dim % 2] = qbits[n * hd + x];
    }
  }

  // 1. scores
  s.scores.resize(tiles * 256);
  for (int64_t t = 0; t < tiles; ++t) {
    const char* k = reinterpret_cast<const char*>(slot_ptr(kp, p0 + t * TILE));
    if (t + 1 < tiles) prefetch_tile(slot_ptr(kp, p0 + (t + 1) * TILE), row_bytes, width * 2);
    _tile_zero(0);
    for (int64_t dt = 0; dt < dim_tiles; ++dt) {
      _tile_loadd(T_K, k + dt * 64, row_bytes);
      _tile_loadd(T_Q, s.qt.data() + dt * 512, 64);
      _tile_dpbf16ps(0, T_K, T_Q);
    }
    _tile_stored(0, s.scores.data() + t * 256, 64);
  }

  // 2. softmax per head (a column), positions outside [first, ctx) weigh nothing
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t r = 0; r < TILE; ++r) {
      const int64_t pos = p0 + t * TILE + r;
      float* row = s.scores.data() + t * 256 + r * 16;
      if (pos < first || pos >= ctx) continue;
      const __m512 x = _mm512_mul_ps(_mm512_load_ps(row), vscale);
      _mm512_store_ps(row, x);
      mx = _mm512_max_ps(mx, x);
    }
  }
  alignas(64) float mxs[16], sum[16] = {};
  _mm512_store_ps(mxs, mx);
  // Column r of a tile's [16 positions][16 heads] block, gathered and rounded into P's row.
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  s.pt.assign(tiles * 256, 0);  // heads past nq stay zero
  for (int64_t t = 0; t < tiles; ++t) {
    float* block = s.scores.data() + t * 256;
    for (int64_t r = 0; r < TILE; ++r) {
      const int64_t pos = p0 + t * TILE + r;
      float* row = block + r * 16;
      if (pos < first || pos >= ctx) {
        std::fill(row, row + 16, 0.f);
        continue;
      }
#pragma omp simd
      for (int n = 0; n < 16; ++n) {
        row[n] = fast_exp(row[n] - mxs[n]);
        sum[n] += row[n];
      }
    }
    uint16_t* pt = s.pt.data() + t * 256;  // transposed: [head][position]
    for (int64_t n = 0; n < nq; ++n) {
      const __m512 col = _mm512_i32gather_ps(column, block + n, 4);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pt + n * 16), (__m256i)_mm512_cvtneps_pbh(col));
    }
  }

  // 3. out = P V, 64 output dims (one KV head's, or part of one) at a time
  for (int64_t cg = 0; cg < width / 64; ++cg) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < tiles; ++t) {
      if (t + 1 < tiles) prefetch_tile(slot_ptr(vp, p0 + (t + 1) * TILE) + cg * 64, row_bytes, 128);
      // A tile's 16 positions are consecutive slots of one block.
      const uint16_t* v = reinterpret_cast<const uint16_t*>(slot_ptr(vp, p0 + t * TILE)) + cg * 64;
      const int64_t lo = std::max<int64_t>(first - p0 - t * TILE, 0), hi = std::min<int64_t>(ctx - p0 - t * TILE, TILE);
      for (int64_t pair = 0; pair < TILE / 2; ++pair) {
        const int64_t r = 2 * pair;
        interleave_pair(r >= lo && r < hi ? v + r * nkv * hd : nullptr,
                        r + 1 >= lo && r + 1 < hi ? v + (r + 1) * nkv * hd : nullptr, s.vt + pair * 128);
      }
      _tile_loadd(T_P, s.pt.data() + t * 256, 32);
      _tile_loadd(T_V, s.vt, 256);
      _tile_dpbf16ps(0, T_P, T_V);
      _tile_loadd(T_V, s.vt + 32, 256);
      _tile_dpbf16ps(1, T_P, T_V);
      _tile_loadd(T_V, s.vt + 64, 256);
      _tile_dpbf16ps(2, T_P, T_V);
      _tile_loadd(T_V, s.vt + 96, 256);
      _tile_dpbf16ps(3, T_P, T_V);
    }
    _tile_stored(0, s.acc, 256);
    _tile_stored(1, s.acc + 16, 256);
    _tile_stored(2, s.acc + 32, 256);
    _tile_stored(3, s.acc + 48, 256);
    const int64_t kv = cg * 64 / hd, x0 = cg * 64 % hd;  // the KV head these dims belong to
    for (int64_t n = kv * group; n < (kv + 1) * group; ++n) {
      const float inv = 1.f / sum[n];  // float32 sums of the unrounded P
      for (int64_t x = 0; x < 64; ++x) out[n * hd + x0 + x] = store<c10::BFloat16>(s.acc[n * 64 + x] * inv);
    }
  }
}

void decode_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                          float scale, int64_t window, at::Tensor& out) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), W = block_tables.size(1), group = nh / nkv;
  // KV heads per task: as many as fill a tile's 16 query heads (dividing nkv), or one each when
  // there are too few sequences to keep every thread busy.
  int64_t kvc = 1;
  if (D >= 4 * at::get_num_threads())
    for (int64_t c = nkv; c >= 1; --c)
      if (nkv % c == 0 && c * group <= TILE) {
        kvc = c;
        break;
      }
  const int64_t chunks = nkv / kvc;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  parallel_over_sequences(D, chunks, cl, window, [&](int64_t begin, int64_t end) {
    configure_tiles();
    AmxScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / chunks, c0 = (task % chunks) * kvc;
      const int64_t ctx = cl[d], first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      auto* od = op + (d * nh + c0 * group) * hd;
      if (ctx - first <= 0) {
        std::fill(od, od + kvc * group * hd, c10::BFloat16(0.f));
        continue;
      }
      attend_amx(qp + (d * nh + c0 * group) * hd, kp, vp, bt + d * W, first, ctx, nkv, c0, kvc, group, hd,
                 block_size, scale, scratch, od);
    }
    _tile_release();
  });
}
#undef T_P
#undef T_V
#undef T_K
#undef T_Q
#endif  // SLOSERVE_AMX


#ifdef SLOSERVE_AVX512BF16
// ---------------------------------------------------------------- decode attention, AVX512-BF16
//
// For a bf16 cache on a CPU with AVX512-BF16 and no AMX (AMD Zen4). The vector loop above spends
// ~470 cycles per cached position of the embedded model (a float conversion per value, a
// horizontal sum per position and query head): on a 2-vCPU Zen4 EPYC a 200-sequence step's
// attention took 84 ms with the cache hot in L3 as from DRAM, while the memory gives its 0.94 GB
// in 28 ms. Here the products are bf16 pair dot products (vdpbf16ps) on the cached values as they
// are, and the memory is asked for early enough to arrive in time:
//   1. scores: per 16 positions and query head, a vector of partial sums per position, reduced
//      16 -> 1 by a transpose-and-add tree into one vector of the 16 positions' scores;
//   2. softmax over the positions, probabilities rounded to bf16 for the products (as the AMX path
//      and flash attention on GPUs do); the normalizing sum stays float32;
//   3. out += P V: V's rows two positions at a time, their values unpacked into pairs (one per
//      dimension, as the dot product multiplies them by a pair of probabilities), each head's
//      accumulators in registers through a tile of 16 positions.
// A task's V rows are requested (into L2) while its K rows are being scored, and the next task's
// K rows while this one's V rows are summed: a task's rows sit in blocks scattered over the pool,
// so the hardware prefetcher alone waits at every block boundary (an earlier version of this
// kernel that prefetched only a few positions ahead was no faster than the loop from DRAM).

// Lane i: the sum of v[i]'s sixteen lanes.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s two half-sums beside v[2i+1]'s
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i] .. v[4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes summed in pairs
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int64_t kMaxBf16Heads = 64;  // query heads of one task

struct Bf16Scratch {
  std::vector<float, AlignedAllocator<float>> scores;       // [heads][positions, padded to 16]
  std::vector<uint16_t, AlignedAllocator<uint16_t>> probs;  // the same, bf16
  std::vector<__m512i, AlignedAllocator<__m512i>> pairs;    // one KV head's tile of V, unpacked: [8][chunks][lo, hi]
  std::vector<uint16_t, AlignedAllocator<uint16_t>> zeros;  // a row of zeros, for positions past the context
};

// Requests `rows` cached rows of `bytes` bytes each (positions [p0, p0 + rows) of a task) into L2.
inline void prefetch_rows_l2(const uint16_t* base, const int64_t* table, int64_t block_size, int64_t nkv,
                             int64_t g0, int64_t hd, int64_t p0, int64_t rows, int64_t bytes) {
  for (int64_t pos = p0; pos < p0 + rows; ++pos) {
    const char* r = reinterpret_cast<const char*>(
        base + ((table[pos / block_size] * block_size + pos % block_size) * nkv + g0) * hd);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
  }
}

// One decode task: a sequence's KV heads [g0, g1), positions [first, ctx).
struct Bf16Task {
  const uint16_t* q;  // the task's query heads, [heads][hd]
  const int64_t* table;
  int64_t first, ctx, g0, g1;
  c10::BFloat16* out;
};

template <int HD>
void attend_bf16(const Bf16Task& t, const Bf16Task* next, const uint16_t* kp, const uint16_t* vp, int64_t nkv,
                 int64_t group, int64_t block_size, float scale, Bf16Scratch& s) {
  constexpr int64_t chunks = HD / 32;  // 32 bf16 values a vector
  const int64_t kv_heads = t.g1 - t.g0, heads = kv_heads * group, width = kv_heads * HD;
  const int64_t n = t.ctx - t.first, padded = (n + 15) / 16 * 16;
  auto row = [&](const uint16_t* base, int64_t pos) {  // KV head g0 of a position
    return base + ((t.table[pos / block_size] * block_size + pos % block_size) * nkv + t.g0) * HD;
  };
  s.scores.resize(heads * padded);
  s.probs.resize(heads * padded);
  s.pairs.resize(8 * chunks * 2);
  if (static_cast<int64_t>(s.zeros.size()) < width) s.zeros.assign(width, 0);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  const uint16_t* rows[16];

  // 1. scores; meanwhile this task's V rows are requested, a tile's worth per tile
  for (int64_t b = 0; b < n; b += 16) {
    const int64_t count = std::min<int64_t>(16, n - b);
    prefetch_rows_l2(vp, t.table, block_size, nkv, t.g0, HD, t.first + b, count, width * 2);
    for (int64_t j = 0; j < 16; ++j) rows[j] = j < count ? row(kp, t.first + b + j) : s.zeros.data();
    const __mmask16 valid = static_cast<__mmask16>(count == 16 ? 0xFFFF : (1u << count) - 1);
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* qh = t.q + h * HD;
      const int64_t off = (h / group) * HD;
      __m512i qv[chunks];
      for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_si512(qh + 32 * c);
      __m512 part[16];
      for (int64_t j = 0; j < 16; ++j) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) acc = dot_pairs(acc, _mm512_loadu_si512(rows[j] + off + 32 * c), qv[c]);
        part[j] = acc;
      }
      _mm512_store_ps(s.scores.data() + h * padded + b,
                      _mm512_mask_mov_ps(ninf, valid, _mm512_mul_ps(sum_lanes16(part), vscale)));
    }
  }

  // 2. softmax per head: unnormalized probabilities in bf16, 1 / their float32 sum kept
  float inv[kMaxBf16Heads];
  for (int64_t h = 0; h < heads; ++h) {
    const float* sh = s.scores.data() + h * padded;
    __m512 mx = ninf;
    for (int64_t b = 0; b < padded; b += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(sh + b));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < padded; b += 16) {
      const __mmask16 valid = static_cast<__mmask16>(n - b >= 16 ? 0xFFFF : (1u << (n - b)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(_mm512_load_ps(sh + b), m)));
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(s.probs.data() + h * padded + b),
                         (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv[h] = 1.f / _mm512_reduce_add_ps(sum);
  }

  // 3. out = P V / sum. Accumulator lane 4L + i of a chunk's `lo` holds dimension 8L + i, of its
  // `hi` 8L + 4 + i (what unpacklo/hi_epi16 make of two rows); put back in order at the end.
  __m512 acc[kMaxBf16Heads][chunks][2];
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < chunks; ++c) acc[h][c][0] = acc[h][c][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < n; b += 16) {
    const int64_t count = std::min<int64_t>(16, n - b);
    if (next != nullptr) {  // the next task's K rows, spread over this task's tiles
      const int64_t nn = next->ctx - next->first, tiles = (n + 15) / 16, share = (nn + tiles - 1) / tiles;
      const int64_t p0 = b / 16 * share, rows_now = std::max<int64_t>(0, std::min(share, nn - p0));
      prefetch_rows_l2(kp, next->table, block_size, nkv, next->g0, HD, next->first + p0, rows_now,
                       (next->g1 - next->g0) * HD * 2);
    }
    for (int64_t j = 0; j < 16; ++j) rows[j] = j < count ? row(vp, t.first + b + j) : s.zeros.data();
    const uint16_t* pb = s.probs.data() + b;
    for (int64_t g = 0; g < kv_heads; ++g) {
      __m512i* pairs = s.pairs.data();
      for (int64_t p = 0; p < 8; ++p)
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512i x = _mm512_loadu_si512(rows[2 * p] + g * HD + 32 * c);
          const __m512i y = _mm512_loadu_si512(rows[2 * p + 1] + g * HD + 32 * c);
          pairs[(p * chunks + c) * 2] = _mm512_unpacklo_epi16(x, y);
          pairs[(p * chunks + c) * 2 + 1] = _mm512_unpackhi_epi16(x, y);
        }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        __m512 a[chunks][2];
        for (int64_t c = 0; c < chunks; ++c) a[c][0] = acc[h][c][0], a[c][1] = acc[h][c][1];
        const uint16_t* ph = pb + h * padded;
        for (int64_t p = 0; p < 8; ++p) {
          int32_t pp;
          std::memcpy(&pp, ph + 2 * p, sizeof pp);
          const __m512i w = _mm512_set1_epi32(pp);
          for (int64_t c = 0; c < chunks; ++c) {
            a[c][0] = dot_pairs(a[c][0], pairs[(p * chunks + c) * 2], w);
            a[c][1] = dot_pairs(a[c][1], pairs[(p * chunks + c) * 2 + 1], w);
          }
        }
        for (int64_t c = 0; c < chunks; ++c) acc[h][c][0] = a[c][0], acc[h][c][1] = a[c][1];
      }
    }
  }
  // dims 0-15 of a chunk: lo lanes 0-3, hi 0-3, lo 4-7, hi 4-7; dims 16-31 the same from lanes 8-15
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 f = _mm512_set1_ps(inv[h]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 d0 = _mm512_mul_ps(_mm512_permutex2var_ps(acc[h][c][0], first_half, acc[h][c][1]), f);
      const __m512 d1 = _mm512_mul_ps(_mm512_permutex2var_ps(acc[h][c][0], second_half, acc[h][c][1]), f);
      c10::BFloat16* o = t.out + h * HD + 32 * c;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(d0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), (__m256i)_mm512_cvtneps_pbh(d1));
    }
  }
}

// Whether the AVX512-BF16 kernel takes these tensors: bf16 query and cache, head size 64 or 128.
bool bf16_decode_serves(const at::Tensor& q, const at::Tensor& k_cache) {
  const int64_t hd = q.size(2);
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && (hd == 64 || hd == 128) &&
         q.size(1) <= kMaxBf16Heads;
}

void decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                           float scale, int64_t window, at::Tensor& out) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), W = block_tables.size(1), group = nh / nkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // a task: one sequence (all KV heads), or one (sequence, KV head) when sequences are few
  const int64_t split = D < 4 * at::get_num_threads() ? nkv : 1, per_task = nkv / split;
  auto task = [&](int64_t i) {
    const int64_t d = i / split, g0 = (i % split) * per_task, ctx = cl[d];
    return Bf16Task{qp + (d * nh + g0 * group) * hd, bt + d * W,
                    window > 0 ? std::max<int64_t>(0, ctx - window) : 0, ctx, g0, g0 + per_task,
                    op + (d * nh + g0 * group) * hd};
  };
  parallel_over_sequences(D, split, cl, window, [&](int64_t begin, int64_t end) {
    Bf16Scratch s;
    Bf16Task next = task(begin);
    for (int64_t i = begin; i < end; ++i) {
      const Bf16Task t = next;
      if (i + 1 < end) next = task(i + 1);
      if (t.ctx - t.first <= 0) {
        std::fill(t.out, t.out + (t.g1 - t.g0) * group * hd, c10::BFloat16(0.f));
        continue;
      }
      const Bf16Task* ahead = i + 1 < end ? &next : nullptr;
      if (hd == 64) {
        attend_bf16<64>(t, ahead, kp, vp, nkv, group, block_size, scale, s);
      } else {
        attend_bf16<128>(t, ahead, kp, vp, nkv, group, block_size, scale, s);
      }
    }
  });
}
#endif  // SLOSERVE_AVX512BF16

template <typename scalar_t, typename cache_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           int64_t block_size, float scale, int64_t window, at::Tensor& out) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), W = block_tables.size(1);
  const int64_t group = nh / nkv;  // query heads per KV head (GQA); those of KV head h: [h*group, (h+1)*group)
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  // A task is one sequence, all its KV heads: each cached row (all KV heads of a position,
  // contiguous) is then read once, front to back. With fewer sequences than a few per thread,
  // a task is one (sequence, KV head) instead, so one long sequence still uses every core.
  const int64_t split = D < 4 * at::get_num_threads() ? nkv : 1;
  const int64_t per_task = nkv / split;
  parallel_over_sequences(D, split, cl, window, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(nh * hd), acc(nh * hd), row(nkv * hd);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / split, h0 = (task % split) * per_task, h1 = h0 + per_task;
      const int64_t ctx = cl[d];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t heads = per_task * group;
      scalar_t* od = op + (d * nh + h0 * group) * hd;
      if (ctx - first <= 0) {
        std::fill(od, od + heads * hd, scalar_t(0));
        continue;
      }
      scores.resize(heads * (ctx - first));  // [query head][position]
      const scalar_t* qd = qp + (d * nh + h0 * group) * hd;
      for (int64_t x = 0; x < heads * hd; ++x) qf[x] = load(qd[x]);
      const int64_t* table = bt + d * W;
      if (hd == 64) {
        attend<scalar_t, cache_t, 64>(qf.data(), kp, vp, table, first, ctx, nkv, h0, h1, group, hd, block_size,
                                      scale, scores.data(), row.data(), acc.data(), od);
      } else if (hd == 128) {
        attend<scalar_t, cache_t, 128>(qf.data(), kp, vp, table, first, ctx, nkv, h0, h1, group, hd, block_size,
                                       scale, scores.data(), row.data(), acc.data(), od);
      } else {
        attend<scalar_t, cache_t, 0>(qf.data(), kp, vp, table, first, ctx, nkv, h0, h1, group, hd, block_size,
                                     scale, scores.data(), row.data(), acc.data(), od);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q,             // [D, nh, hd]
                                     const at::Tensor& k_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                     const at::Tensor& v_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                     const at::Tensor& block_tables,  // [D, W] int64
                                     const at::Tensor& context_lens,  // [D] int64
                                     int64_t block_size, double scale, int64_t window,
                                  const std::string& kernel) {
  check_kernel_name(kernel);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (int8_cache || q.scalar_type() == k_cache.scalar_type()),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype (or the caches be both int8)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2) + (int8_cache ? 4 : 0),
              "head shapes do not match");
  auto out = at::empty_like(q);
#ifdef SLOSERVE_AMX
  if ((kernel == "auto" || kernel == "amx") && amx_serves(q, k_cache, block_size)) {
    decode_attention_amx(q, k_cache, v_cache, block_tables, context_lens, block_size, static_cast<float>(scale),
                         window, out);
    return out;
  }
#endif
  TORCH_CHECK(kernel != "amx", "paged_decode_attention: the amx kernel cannot take these tensors here");
#ifdef SLOSERVE_AVX512BF16
  if ((kernel == "auto" || kernel == "avx512_bf16") && bf16_decode_serves(q, k_cache)) {
    decode_attention_bf16(q, k_cache, v_cache, block_tables, context_lens, block_size, static_cast<float>(scale),
                          window, out);
    return out;
  }
#endif
  TORCH_CHECK(kernel != "avx512_bf16", "paged_decode_attention: the avx512_bf16 kernel cannot take these tensors");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (int8_cache) {
      decode_attention_impl<scalar_t, int8_t>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                              static_cast<float>(scale), window, out);
    } else {
      decode_attention_impl<scalar_t, scalar_t>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                                static_cast<float>(scale), window, out);
    }
  });
  return out;
}

std::vector<std::string> attention_kernels() {
  std::vector<std::string> out;
#ifdef SLOSERVE_AMX
  if (amx_permitted()) out.push_back("amx");
#endif
#ifdef SLOSERVE_AVX512BF16
  out.push_back("avx512_bf16");
#endif
  out.push_back("portable");
  return out;
}

void check_kernel_name(const std::string& kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "amx" || kernel == "avx512_bf16" || kernel == "portable",
              "unknown attention kernel '", kernel, "' (auto, amx, avx512_bf16 or portable)");
  if (kernel == "auto" || kernel == "portable") return;
  const auto here = attention_kernels();
  TORCH_CHECK(std::find(here.begin(), here.end(), kernel) != here.end(), "the ", kernel,
              " attention kernel is not available on this machine");
}

}  // namespace sloserve
