// sloserve's native CPU kernels (float32, bfloat16 or float16 tensors), compiled on first use.
//
// 1. Decode attention straight from the paged KV cache.
// 2. The fused elementwise work of a decoder layer: RMSNorm (with the residual add), SiLU-and-mul,
//    in-place RoPE.
//
// Arithmetic is in float32 whatever the tensors' type. 16-bit values are converted with the bit
// operations below rather than c10's scalar conversions, so the loops vectorize.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SLOSERVE_AMX 1
#endif

namespace {

template <typename T>
inline float load(T v) {
  return static_cast<float>(v);
}

template <>
inline float load(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T>
inline T store(float f) {
  return static_cast<T>(f);
}

template <>
inline c10::BFloat16 store(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // to nearest even
  c10::BFloat16 out;
  out.x = f != f ? static_cast<uint16_t>(0x7FC0) : rounded;  // NaN stays a (quiet) NaN
  return out;
}

// exp(x) written so the compiler vectorizes it (libm's expf is a scalar call per element):
// 2^(x log2 e) as an integer power built into the exponent bits times a degree-6 polynomial
// on [-0.5, 0.5]; relative error below 2e-7. Clamped to [-87, 88], the float32 range.
#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

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

// at::parallel_for cuts a range into equal counts, but a task's cost is its sequence's context:
// with ShareGPT's spread of prompt lengths one thread got most of the positions while the other
// waited. Here each thread gets one contiguous run of tasks of about equal context.
// Runs tasks [0, costs.size()) on the threads, each thread one contiguous run of about equal
// total cost: body(begin, end) once per non-empty run, on its thread.
template <typename F>
void parallel_balanced(const std::vector<int64_t>& costs, const F& body) {
  const int64_t tasks = costs.size();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> bounds(threads + 1, tasks);
  bounds[0] = 0;
  int64_t done = 0, next = 1;
  for (int64_t t = 0; t < tasks && next < threads; ++t) {
    done += costs[t];
    if (done * threads >= total * next) bounds[next++] = t + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      if (bounds[k] < bounds[k + 1]) body(bounds[k], bounds[k + 1]);
  });
}

template <typename F>
void parallel_over_sequences(int64_t sequences, int64_t per_sequence, const int64_t* context_lens, int64_t window,
                             const F& body) {
  std::vector<int64_t> costs(sequences * per_sequence);
  for (int64_t t = 0; t < static_cast<int64_t>(costs.size()); ++t) {
    const int64_t ctx = context_lens[t / per_sequence];
    costs[t] = (window > 0 ? std::min(ctx, window) : ctx) + 16;  // + a fixed cost per task
  }
  parallel_balanced(costs, body);
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

// Linux hands the tile state only to processes that ask for it (once, for every thread).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate (scores, then four 16-dim column groups of the output). GCC's tile
// intrinsics paste the tile number into the assembly, so these must be literal macros.
#define T_P 4
#define T_V 5
#define T_K 6
#define T_Q 7
constexpr int64_t TILE = 16;  // positions per tile, heads per tile row block

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

// 64-byte aligned storage, for whole-vector loads and stores.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const AlignedAllocator&) const { return true; }
};

struct AmxScratch {
  std::vector<uint16_t> qt;      // Q^T tiles, one per 32 dims of the chunk: [16][32]
  std::vector<float, AlignedAllocator<float>> scores;   // [tiles][16 positions][16 heads], then P
  std::vector<uint16_t, AlignedAllocator<uint16_t>> pt;  // P per tile, transposed: [16 heads][16 positions] bf16
  alignas(64) uint16_t vt[8 * 128];  // V of one tile, 64 dims, position pairs interleaved: [8][64 x 2]
  alignas(64) float acc[16 * 64];    // the four accumulators stored: [16 heads][64 dims]
};


// Rows r and r+1 (64 bf16 each, nullptr = zeros) interleaved element by element into dst[128].
inline void interleave_pair(const uint16_t* a, const uint16_t* b, uint16_t* dst) {
  static const __m512i lo = [] {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>((i / 2) + (i % 2) * 32);
    return _mm512_load_si512(idx);
  }();
  static const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int half = 0; half < 2; ++half) {
    const __m512i x = a ? _mm512_loadu_si512(a + half * 32) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_loadu_si512(b + half * 32) : _mm512_setzero_si512();
    _mm512_store_si512(dst + half * 64, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_store_si512(dst + half * 64 + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
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

// bf16 q and cache, head size a multiple of 64, tiles inside blocks, a KV head's query heads in one tile.
bool amx_serves(const torch::Tensor& q, const torch::Tensor& k_cache, int64_t block_size) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && hd % 64 == 0 &&
         block_size % TILE == 0 && nh / nkv <= TILE && amx_permitted();
}

void decode_attention_amx(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t block_size,
                          float scale, int64_t window, torch::Tensor& out) {
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

// ---------------------------------------------------------------- prefill attention on AMX tiles
//
// Causal attention of a step's prefill chunks to their whole context (cached prefix and the
// chunk itself, both read from the paged cache after the chunk's K/V are written), flash-style
// per (chunk, query head, 16 queries), 32 keys at a time. torch's CPU flash attention, one call
// per chunk and layer, reached 110-360 GFLOP/s on ShareGPT-sized chunks (mostly fixed costs on
// the short ones) and was ~40% of a prefill step.
//
// The scores are computed transposed, S^T [keys][queries] = K Q^T: K tiles load straight from
// the cache rows, and each key's scores across the 16 queries fill one vector register, so the
// softmax needs no horizontal reductions (the running max and sum are per-lane vectors). The
// output accumulates transposed as well, O^T [dims][queries] += V^T P^T, in four tiles that stay
// in the tile unit across key blocks: the running max is raised lazily (only when a block's max
// exceeds it by RESCALE_MARGIN, as FlashAttention-3 does), so the accumulators are rarely taken
// out to be rescaled. V^T is packed once per (chunk, KV head) and shared by the KV head's query
// heads and every query block.

// fast_exp above, sixteen at a time.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  return _mm512_castsi512_ps(bits);
}

constexpr float RESCALE_MARGIN = 8.0f;  // probabilities up to e^8 before a rescale: far inside bf16 and float32
constexpr int64_t KEYS = 32;             // keys per block: one PV product

void configure_prefill_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {  // every tile 16 rows x 64 bytes
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  asm volatile("" ::: "memory");  // see configure_tiles
  _tile_loadconfig(&c);
}

// Tiles: 0-3 O^T (16 dims x 16 queries each), 4 S^T, 5 K, 6 Q^T then P^T, 7 V^T.
#define PT_S 4
#define PT_K 5
#define PT_B 6
#define PT_V 7

struct PrefillTask {
  int64_t span, head, qblock, cost;
};

// The 16 x 16 products of 32 keys x 16 queries, for output dims [64 cg, 64 cg + 64).
struct PrefillScratch {
  alignas(64) uint16_t qt[4][16 * 32];  // Q^T, pair-interleaved by dimension, per 32 dims (hd <= 128)
  alignas(64) float st[KEYS * 16];      // S^T of one key block
  alignas(64) uint16_t pt[16 * 32];     // P^T, pair-interleaved by key
  alignas(64) float ot[64 * 16];        // O^T taken out of the tiles
};

inline void store_o(float* ot) {
  _tile_stored(0, ot, 64);
  _tile_stored(1, ot + 256, 64);
  _tile_stored(2, ot + 512, 64);
  _tile_stored(3, ot + 768, 64);
}

inline void load_o(const float* ot) {
  _tile_loadd(0, ot, 64);
  _tile_loadd(1, ot + 256, 64);
  _tile_loadd(2, ot + 512, 64);
  _tile_loadd(3, ot + 768, 64);
}

void prefill_attention_amx(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables, const torch::Tensor& spans, int64_t block_size, float scale,
                           int64_t window, torch::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1), group = nh / nkv;
  const int64_t S = spans.size(0), W = tables.size(1);
  const int64_t* sp = spans.data_ptr<int64_t>();  // [S, 3]: first row in q, rows, start position
  const int64_t* bt = tables.data_ptr<int64_t>();
  const auto* kp = reinterpret_cast<const char*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t kv_row = nkv * hd;    // cache elements between positions
  const int64_t q_row = q.stride(0);  // q may be a view into the fused QKV output
  auto slot = [&](int64_t s, int64_t pos) { return bt[s * W + pos / block_size] * block_size + pos % block_size; };

  // 1. V^T per (chunk, 32-key block, KV head): [hd][32 keys], zero past the context
  std::vector<int64_t> first_block(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) first_block[s + 1] = first_block[s] + (sp[3 * s + 2] + sp[3 * s + 1] + KEYS - 1) / KEYS;
  const int64_t block_elems = KEYS * hd;
  std::vector<uint16_t, AlignedAllocator<uint16_t>> vpack(first_block[S] * nkv * block_elems);
  at::parallel_for(0, first_block[S], 8, [&](int64_t begin, int64_t end) {
    for (int64_t gb = begin; gb < end; ++gb) {
      const int64_t s = std::upper_bound(first_block.begin(), first_block.end(), gb) - first_block.begin() - 1;
      const int64_t kb = gb - first_block[s], ctx = sp[3 * s + 2] + sp[3 * s + 1];
      for (int64_t j = 0; j < KEYS; ++j) {
        const int64_t pos = kb * KEYS + j;
        const uint16_t* vrow = pos < ctx ? vp + slot(s, pos) * kv_row : nullptr;
        for (int64_t g = 0; g < nkv; ++g) {
          uint16_t* vd = vpack.data() + (gb * nkv + g) * block_elems;
          for (int64_t x = 0; x < hd; ++x) vd[x * KEYS + j] = vrow ? vrow[g * hd + x] : 0;
        }
      }
    }
  });

  // 2. tasks: (chunk, query head, 16 queries), costed by the key blocks they visit
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = sp[3 * s + 1], start = sp[3 * s + 2];
    for (int64_t qb = 0; qb * TILE < n; ++qb) {
      const int64_t last = start + std::min(n, (qb + 1) * TILE) - 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + qb * TILE - window + 1) : 0;
      for (int64_t h = 0; h < nh; ++h) tasks.push_back({s, h, qb, last / KEYS - lo / KEYS + 2});
    }
  }
  std::vector<int64_t> costs(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) costs[t] = tasks[t].cost;

  // 3. flash attention per task
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // [a0..a15 | b0..b15] -> a0 b0 a1 b1 ...: two keys' probabilities pair-interleaved
  const __m512i pair_idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                             0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                             0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
  parallel_balanced(costs, [&](int64_t tb, int64_t te) {
    configure_prefill_tiles();
    PrefillScratch w;
    for (int64_t ti = tb; ti < te; ++ti) {
      const PrefillTask& t = tasks[ti];
      const int64_t row0 = sp[3 * t.span], n = sp[3 * t.span + 1], start = sp[3 * t.span + 2];
      const int64_t ctx = start + n, g = t.head / group, q0 = t.qblock * TILE;
      const int64_t rows = std::min<int64_t>(TILE, n - q0);
      const int64_t last = start + q0 + rows - 1;  // the block's last query position
      const int64_t lo = window > 0 ? std::max<int64_t>(0, start + q0 - window + 1) : 0;
      const __mmask16 qvalid = static_cast<__mmask16>((1u << rows) - 1);
      const __m512i qpos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(start + q0)));
      const __m512i qfloor = _mm512_sub_epi32(qpos, _mm512_set1_epi32(static_cast<int>(window)));
      // Q^T tiles: qt[dt][i][2 q + e] = q[q][32 dt + 2 i + e]
      for (int64_t dt = 0; dt < hd / 32; ++dt) std::fill(w.qt[dt], w.qt[dt] + 512, 0);
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* qr = qp + (row0 + q0 + r) * q_row + t.head * hd;
        for (int64_t x = 0; x < hd; ++x) w.qt[x / 32][((x % 32) / 2) * 32 + 2 * r + x % 2] = qr[x];
      }
      for (int64_t cg = 0; cg < hd / 64; ++cg) {  // output dims [64 cg, 64 cg + 64): the scores are redone per group
        __m512 m = ninf, l = _mm512_setzero_ps();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = lo / KEYS; kb <= last / KEYS; ++kb) {
          for (int64_t half = 0; half < 2; ++half) {  // S^T for keys [k0, k0 + 16)
            const int64_t k0 = kb * KEYS + half * TILE;
            if (k0 >= ctx) {
              std::fill(w.st + half * 256, w.st + half * 256 + 256, 0.f);
              continue;
            }
            const char* krows = kp + (slot(t.span, k0) * kv_row + g * hd) * 2;
            _tile_zero(PT_S);
            for (int64_t dt = 0; dt < hd / 32; ++dt) {
              _tile_loadd(PT_K, krows + dt * 64, kv_row * 2);
              _tile_loadd(PT_B, w.qt[dt], 64);
              _tile_dpbf16ps(PT_S, PT_K, PT_B);
            }
            _tile_stored(PT_S, w.st + half * 256, 64);
          }
          // masks and this block's max, per query lane
          __mmask16 keep[KEYS];
          __m512 bmax = ninf;
          for (int64_t j = 0; j < KEYS; ++j) {
            const int64_t kpos = kb * KEYS + j;
            const __m512i kv = _mm512_set1_epi32(static_cast<int>(kpos));
            __mmask16 kk = qvalid & _mm512_cmp_epi32_mask(kv, qpos, _MM_CMPINT_LE);
            if (window > 0) kk &= _mm512_cmp_epi32_mask(kv, qfloor, _MM_CMPINT_NLE);
            keep[j] = kk;
            const __m512 x = _mm512_mask_mul_ps(ninf, kk, _mm512_load_ps(w.st + j * 16), _mm512_set1_ps(scale));
            _mm512_store_ps(w.st + j * 16, x);
            bmax = _mm512_max_ps(bmax, x);
          }
          // raise the running max where this block exceeds it by the margin (or it was unset)
          const __mmask16 raise = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(m, _mm512_set1_ps(RESCALE_MARGIN)),
                                                     _CMP_GT_OQ);
          if (raise) {
            const __m512 mnew = _mm512_mask_mov_ps(m, raise, bmax);
            const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ) & raise;
            const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), raise,
                                                    _mm512_maskz_mov_ps(had, fast_exp16(_mm512_sub_ps(m, mnew))));
            l = _mm512_mul_ps(l, alpha);
            if (had) {  // accumulators hold something to rescale
              store_o(w.ot);
              for (int64_t d = 0; d < 64; ++d)
                _mm512_store_ps(w.ot + d * 16, _mm512_mul_ps(_mm512_load_ps(w.ot + d * 16), alpha));
              load_o(w.ot);
            }
            m = mnew;
          }
          // probabilities, pair-interleaved by key into P^T
          for (int64_t j = 0; j < KEYS; j += 2) {
            const __m512 e0 = _mm512_maskz_mov_ps(keep[j], fast_exp16(_mm512_sub_ps(_mm512_load_ps(w.st + j * 16), m)));
            const __m512 e1 =
                _mm512_maskz_mov_ps(keep[j + 1], fast_exp16(_mm512_sub_ps(_mm512_load_ps(w.st + (j + 1) * 16), m)));
            l = _mm512_add_ps(l, _mm512_add_ps(e0, e1));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0 in the low half
            _mm512_store_si512(w.pt + j * 16, _mm512_permutexvar_epi16(pair_idx, both));
          }
          // O^T += V^T P^T
          const uint16_t* vt = vpack.data() + ((first_block[t.span] + kb) * nkv + g) * block_elems + cg * 64 * KEYS;
          _tile_loadd(PT_B, w.pt, 64);
          _tile_loadd(PT_V, vt, 64);
          _tile_dpbf16ps(0, PT_V, PT_B);
          _tile_loadd(PT_V, vt + 16 * KEYS, 64);
          _tile_dpbf16ps(1, PT_V, PT_B);
          _tile_loadd(PT_V, vt + 32 * KEYS, 64);
          _tile_dpbf16ps(2, PT_V, PT_B);
          _tile_loadd(PT_V, vt + 48 * KEYS, 64);
          _tile_dpbf16ps(3, PT_V, PT_B);
        }
        store_o(w.ot);
        alignas(64) float inv[16];
        _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                 _mm512_set1_ps(1.f), l));
        for (int64_t r = 0; r < rows; ++r) {
          c10::BFloat16* dst = op + ((row0 + q0 + r) * nh + t.head) * hd + cg * 64;
          for (int64_t d = 0; d < 64; ++d) dst[d] = store<c10::BFloat16>(w.ot[d * 16 + r] * inv[r]);
        }
      }
    }
    _tile_release();
  });
}
#undef PT_S
#undef PT_K
#undef PT_B
#undef PT_V
#undef T_P
#undef T_V
#undef T_K
#undef T_Q
#endif  // SLOSERVE_AMX

template <typename scalar_t, typename cache_t>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                           int64_t block_size, float scale, int64_t window, torch::Tensor& out) {
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

// ---------------------------------------------------------------- fused elementwise ops

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const float v = load(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / load(h) + eps);
      scalar_t* o = out + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = store<scalar_t>(load(xr[i]) * inv * load(w[i]));
    }
  });
}

template <typename scalar_t>
void add_rows(scalar_t* res, const scalar_t* d, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < h; ++i)
        res[r * h + i] = store<scalar_t>(load(res[r * h + i]) + load(d[r * h + i]));
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* o, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * inter;
      const scalar_t* u = g + inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g[i]);
        o[r * inter + i] = store<scalar_t>(gv / (1.f + fast_exp(-gv)) * load(u[i]));
      }
    }
  });
}

template <typename scalar_t>
void rope_rows(scalar_t* base, const scalar_t* c, const scalar_t* s, int64_t rows, int64_t row_stride,
               int64_t num_heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(dim), sf(dim), lo(half), hi(half);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* cr = c + r * dim;
      const scalar_t* sr = s + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        cf[i] = load(cr[i]);
        sf[i] = load(sr[i]);
      }
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        scalar_t* v = base + r * row_stride + hd * dim;
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); via float buffers, so the
        // loops carry no aliasing between what they read and what they write.
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(v[i]), b = load(v[i + half]);
          lo[i] = a * cf[i] - b * sf[i];
          hi[i] = b * cf[i + half] + a * sf[i + half];
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          v[i] = store<scalar_t>(lo[i]);
          v[i + half] = store<scalar_t>(hi[i]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------- greedy sampling

// The index of the largest value of x[n] (the first on ties; the first NaN if any, as torch's
// max does). Two passes over a row that the LM head has just written (it sits in cache): the
// max, then the first position holding it, a vector's width at a time.
template <typename scalar_t>
int64_t argmax_row_scalar(const scalar_t* x, int64_t n) {
  float best = load(x[0]);
  int64_t at = 0;
  for (int64_t i = 1; i < n && best == best; ++i) {
    const float v = load(x[i]);
    if (v > best || v != v) best = v, at = i;
  }
  return at;
}

#ifndef __AVX512F__
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  return argmax_row_scalar(x, n);
}
#else
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const double*) { return _mm512_setzero_ps(); }  // unused: doubles take the scalar loop

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, double>) return argmax_row_scalar(x, n);
  const int64_t vec_end = n / 16 * 16;
  __m512 best16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan_lanes = 0;
  for (int64_t i = 0; i < vec_end; i += 16) {
    const __m512 v = load16(x + i);
    best16 = _mm512_max_ps(best16, v);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float best = _mm512_reduce_max_ps(best16);
  bool nans = nan_lanes != 0;
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = load(x[i]);
    best = std::max(best, v);
    nans |= v != v;
  }
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t i = 0; i < vec_end; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 hit = nans ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = load(x[i]);
    if (nans ? v != v : v == best) return i;
  }
  return 0;
}
#endif

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q,             // [D, nh, hd]
                                     const torch::Tensor& k_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                     const torch::Tensor& v_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                     const torch::Tensor& block_tables,  // [D, W] int64
                                     const torch::Tensor& context_lens,  // [D] int64
                                     int64_t block_size, double scale, int64_t window, bool allow_amx) {
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (int8_cache || q.scalar_type() == k_cache.scalar_type()),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype (or the caches be both int8)");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2) + (int8_cache ? 4 : 0),
              "head shapes do not match");
  auto out = torch::empty_like(q);
#ifdef SLOSERVE_AMX
  if (allow_amx && amx_serves(q, k_cache, block_size)) {
    decode_attention_amx(q, k_cache, v_cache, block_tables, context_lens, block_size, static_cast<float>(scale),
                         window, out);
    return out;
  }
#endif
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


// Prefill chunks' causal attention to their context in the paged cache, written into `out`'s
// rows of the chunks; false (nothing written) when this build or these tensors cannot take the
// AMX path (the caller then runs SDPA per chunk). spans [S, 3] int64: first row in q, rows,
// start position (tokens of the sequence cached before the chunk); block_tables [S, W].
bool prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& spans, int64_t block_size, double scale,
                       int64_t window, torch::Tensor& out) {
#ifdef SLOSERVE_AMX
  if (!amx_serves(q, k_cache, block_size) || q.size(2) > 128 || v_cache.scalar_type() != k_cache.scalar_type() ||
      out.scalar_type() != q.scalar_type())
    return false;
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "prefill_attention: q [T, nh, hd] with dense rows expected");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && spans.is_contiguous(), "prefill_attention: contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
              spans.size(1) == 3 && block_tables.size(0) == spans.size(0), "prefill_attention: bad spans or tables");
  prefill_attention_amx(q, k_cache, v_cache, block_tables, spans, block_size, static_cast<float>(scale), window, out);
  return true;
#else
  return false;
#endif
}

// out = x / rms(x) * weight, per row of x [T, H].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: contiguous x [T, H] and weight [H] expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// The residual add and the next norm in one pass: residual += delta (rounded to its dtype, as
// `residual + delta` would be), then returns rms_norm(residual) * weight.
torch::Tensor add_rms_norm(torch::Tensor& residual, const torch::Tensor& delta, const torch::Tensor& weight,
                           double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.sizes() == delta.sizes() && residual.is_contiguous() &&
              delta.is_contiguous() && weight.is_contiguous() && weight.numel() == residual.size(1),
              "add_rms_norm: contiguous residual and delta [T, H] and weight [H] expected");
  TORCH_CHECK(residual.scalar_type() == delta.scalar_type() && delta.scalar_type() == weight.scalar_type(),
              "add_rms_norm: tensors must share a dtype");
  const int64_t rows = residual.size(0), h = residual.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rows<scalar_t>(residual.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), rows, h);
  });
  return rms_norm(residual, weight, eps);
}

// SwiGLU's activation: gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: contiguous gate_up [T, 2I] expected");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Rotary embedding in place on the first `num_heads` heads of each row of x [T, heads, D]
// (rotate-half layout: pairs (i, i + D/2)), with cos/sin [T, D] per row.
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_: x [T, heads, D] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rope_: cos/sin [T, D] expected");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "rope_: tensors must share a dtype");
  const int64_t rows = x.size(0), dim = x.size(2), row_stride = x.stride(0);
  TORCH_CHECK(num_heads <= x.size(1) && dim % 2 == 0, "rope_: bad head count or odd head size");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), rows, row_stride,
                        num_heads, dim);
  });
}

// Greedy tokens: the argmax of each row of logits [R, V] (int64 [R]). torch's bf16 argmax is
// scalar (15.7 ms for 200 x 49k) and max().indices, its vectorized stand-in, 3.8 ms.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: contiguous logits [R, V] with V > 0 expected");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(x + r * n, n);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("allow_amx") = true, no_gil);
  m.def("amx_available", [] {
#ifdef SLOSERVE_AMX
    return amx_permitted();
#else
    return false;
#endif
  }, "whether bf16 decode attention runs on AMX tiles here");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", no_gil);
  m.def("rope_", &rope_, "rotary embedding in place", no_gil);
  m.def("prefill_attention", &prefill_attention, "causal prefill attention over a paged KV cache (AMX)", no_gil);
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties)", no_gil);
}
