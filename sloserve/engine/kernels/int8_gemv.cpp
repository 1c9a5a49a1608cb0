// y = x W^T for a few rows with int8 activations: W8A8 (int8 weights, the LM head of a small decode
// step) and W4A8 (the 4-bit layers). One row of a decode step reads every weight byte and does
// little arithmetic with it: the bytes are the cost, and torch's weight-only kernels (codes widened
// in registers, bf16 activations, emulated on a CPU without AVX512-BF16) run well below the
// memory's rate on one core. Integer dot products keep up with memory.
//
// Activations are quantized per 32-element block, q = round(x * 127 / max|x|), with one float
// scale a block (llama.cpp's Q8_0 shape). AVX2 has only an unsigned-by-signed byte product
// (vpmaddubsw, which saturates its int16 pair sums):
// - W8A8: the weights are Int8Linear's codes (symmetric, in [-127, 127]) with one float scale a
//   row. The sign moves onto the activation: |w| * (q * sign(w)) = w * q, each factor within 127,
//   so a pair sum stays within 2 * 127 * 127 < 32767.
// - W4A8: the weights are GroupAffine4's codes (0..15) with a float16 scale d and offset o per
//   group of 32 inputs, eight output columns interleaved (int4_tile_rows below). The unsigned
//   codes are vpmaddubsw's unsigned factor; a block's dot product is d * s * sum(c q) + o * s * sum(q),
//   the second term from the block's activation sum, computed once per row of x.
// The int32 sums of a block are scaled in float and accumulate in float.
//
// AVX512-VNNI (Intel Cascade Lake and later, AMD Zen4 and later) has the same unsigned-by-signed
// product with four bytes summed straight into int32 (vpdpbusd, no saturation): one instruction
// for vpmaddubsw + the int16 add, and no widening vpmaddwd. Its int32 sums are the AVX2 path's
// exactly and the float work is the same in the same order, so both give the same bits; the
// `isa` argument picks one ("auto": the fastest this build has), so one machine can compare them.
#include "common.h"
#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SLOSERVE_VNNI 1
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SLOSERVE_VNNI512 1  // two tiles at once in 512-bit registers
#endif
#endif

namespace sloserve {

namespace {

constexpr int64_t kTileRecord = 160;  // bytes of one tile's block: 128 of codes, 16 of scales, 16 of offsets
// How far ahead of its reads the W4A8 loop asks for weights (eight records): a decode step's small
// matrices are short streams the hardware prefetcher has little time to learn; with the model's
// 66 MB of layers 1.1-1.2x faster than without (Zen3, 1 and 4 rows, alternating runs).
constexpr int kTilePrefetch = 8 * kTileRecord;
// Rows of x a W4A8 product takes through all its tiles at a time (a multiple of every ISA's
// rows per pass, so the groups of rows stay the same).
constexpr int64_t kRowChunk = 64;
// Bytes of one block of the tiled W8A8 layout (quant.w8a8_tiles): 16 columns x 32 inputs.
constexpr int64_t kInt8TileBytes = 16 * 32;
// The fewest rows for which the VNNI path takes W4A8 tiles in pairs (see int4_gemv).
constexpr int64_t kPairRows = 16;

enum class Isa { avx2, vnni };

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Sums of four adjacent u8 x s8 products per int32 lane, added to `acc`. The AVX2 form keeps
// int16 pair sums (callers keep them within int16) and widens them in `widen`.
template <Isa I>
inline __m256i accumulate(__m256i acc, __m256i u, __m256i s) {
#ifdef SLOSERVE_VNNI
  if constexpr (I == Isa::vnni) return _mm256_dpbusd_epi32(acc, u, s);
#endif
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}

template <Isa I>
inline __m256i widen(__m256i acc) {
  if constexpr (I == Isa::vnni) return acc;
  return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}

// How many rows of x one pass over a W4A8 tile serves: its loads and nibble unpacking are shared
// by these rows. AVX2 has 16 vector registers, enough for four rows' accumulators; AVX-512VL's 32
// hold eight. (A row's sums come out the same whatever its group, so every ISA still gives the
// same bits. W8A8 keeps groups of four on both: its chains per row depend on the group's size.)
template <Isa I>
constexpr int int4_max_rows() {
  return I == Isa::vnni ? 8 : 4;
}

// Calls kernel<R>() with R = r (1 <= r <= R0) as a compile-time row count.
template <int R, typename Kernel>
inline void with_rows(int64_t r, Kernel&& kernel) {
  if constexpr (R > 1) {
    if (r < R) return with_rows<R - 1>(r, kernel);
  }
  kernel(std::integral_constant<int, R>{});
}

// x's rows as int8 per 32-element block: codes, each block's scale, and (with `sums`) each block's
// scale times the sum of its codes. Rounding is to nearest even (the default mode), as round() in
// the tests' reference.
struct Int8Rows {
  std::vector<int8_t, AlignedAllocator<int8_t>> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
};

inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// Eight floats from eight float32 or bfloat16 values (bf16 widens exactly: its bits are the top half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Outputs come in the input's type: float32, or bf16 rounded to nearest even as torch converts
// (so a bf16 output is the float32 one converted, bit for bit; NaN stays a quiet NaN). Writing
// bf16 here saves the caller a float32 copy of every product and its conversion pass.
inline __m128i bf16_round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store_value(float* dst, float v) { *dst = v; }
inline void store_value(c10::BFloat16* dst, float v) { *dst = store<c10::BFloat16>(v); }
inline void store8(float* dst, __m256 v, int64_t cols) {
  if (cols == 8) return _mm256_storeu_ps(dst, v);
  alignas(32) float tail[8];  // the last tile of a column count that is not a multiple of eight
  _mm256_store_ps(tail, v);
  std::memcpy(dst, tail, cols * sizeof(float));
}
inline void store8(c10::BFloat16* dst, __m256 v, int64_t cols) {
  const __m128i h = bf16_round8(v);
  if (cols == 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  alignas(16) uint16_t tail[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tail), h);
  std::memcpy(dst, tail, cols * sizeof(uint16_t));
}
#ifdef SLOSERVE_VNNI512
inline void store16(float* dst, __m512 v, __mmask16 keep) { _mm512_mask_storeu_ps(dst, keep, v); }
inline void store16(c10::BFloat16* dst, __m512 v, __mmask16 keep) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(dst, keep, _mm512_cvtepi32_epi16(r));
}
#endif

// Runs body(O*) with the output's data as float32 or bf16 (the input's type).
template <typename Body>
void with_output(at::Tensor& out, Body&& body) {
  if (out.scalar_type() == at::kBFloat16) return body(out.data_ptr<c10::BFloat16>());
  body(out.data_ptr<float>());
}

// Blocks [begin, end) of x (32 values each) into `out`.
template <typename T>
void quantize_blocks(const T* xp, int64_t begin, int64_t end, bool sums, Int8Rows& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t i = begin; i < end; ++i) {
    const T* src = xp + i * 32;
    const __m256 v0 = load8(src), v1 = load8(src + 8);
    const __m256 v2 = load8(src + 16), v3 = load8(src + 24);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // |x| * 127 / max|x| <= 127 up to one rounding, so the saturating packs never clip
    const __m256i i01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)));
    const __m256i i23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv)));
    const __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23), order);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.q.data() + i * 32), q);
    out.scale[i] = amax / 127.0f;
    if (sums) {  // maddubs takes the all-ones vector as its unsigned factor
      const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
      out.scaled_sum[i] = out.scale[i] * static_cast<float>(hsum_epi32(s32));
    }
  }
}

// bf16 rows are read as they are (no float32 copy of x); a prefill's rows are split over the
// threads (a decode step's few rows stay on one: below the grain).
Int8Rows quantize_rows(const at::Tensor& x, bool sums) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  Int8Rows out;
  out.q.resize(M * K);
  out.scale.resize(M * blocks);
  if (sums) out.scaled_sum.resize(M * blocks);
  constexpr int64_t kGrain = 256;  // blocks: 8,192 values
  if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const auto* xp = xc.data_ptr<c10::BFloat16>();
    at::parallel_for(0, M * blocks, kGrain, [&](int64_t b, int64_t e) { quantize_blocks(xp, b, e, sums, out); });
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const float* xp = xf.data_ptr<float>();
    at::parallel_for(0, M * blocks, kGrain, [&](int64_t b, int64_t e) { quantize_blocks(xp, b, e, sums, out); });
  }
  return out;
}

// W8A8, one output column (codes `row`, scale `ws`) for R rows of x: each weight block is loaded
// and its signs taken once for the R rows (against a load per row: 1.19x at 2 rows, ~1.5x at 4-8).
template <Isa I, int R, typename O>
inline void int8_rows(const int8_t* __restrict row, float ws, int64_t K, int64_t blocks, const int8_t* __restrict q,
                      const float* __restrict qs, O* __restrict out, int64_t out_stride) {
  constexpr int A = R >= 4 ? 1 : (R == 1 ? 4 : 2);  // independent chains of fused multiply-adds
  __m256 acc[R][A];
  for (int j = 0; j < R; ++j)
    for (int a = 0; a < A; ++a) acc[j][a] = _mm256_setzero_ps();
  auto block = [&](int64_t b, int a) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
    const __m256i magnitude = _mm256_sign_epi8(wv, wv);
    for (int j = 0; j < R; ++j) {
      const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + j * K + b * 32));
      const __m256i sums = widen<I>(accumulate<I>(_mm256_setzero_si256(), magnitude, _mm256_sign_epi8(qv, wv)));
      acc[j][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                  _mm256_broadcast_ss(qs + j * blocks + b), acc[j][a]);
    }
  };
  // Consecutive blocks go to A independent chains of fused multiply-adds (one chain waits on its
  // own latency); each row's chains are summed at the end.
  int64_t b = 0;
  for (; b + A <= blocks; b += A)
    for (int a = 0; a < A; ++a) block(b + a, a);
  for (; b < blocks; ++b) block(b, 0);
  for (int j = 0; j < R; ++j) {
    __m256 total = acc[j][0];
    for (int a = 1; a < A; ++a) total = _mm256_add_ps(total, acc[j][a]);
    store_value(out + j * out_stride, hsum(total) * ws);
  }
}

// W4A8 over the tiled layout (quant.w4a8_tiles): eight output columns side by side, so one
// vpmaddubsw multiplies four inputs of each of the eight columns with the same four activations
// (broadcast), the eight int32 block sums come out in one vector, and the columns' scales and
// offsets apply as vectors: no horizontal sum per column and block, and no per-column set-up.
// A tile's block is one 160-byte record: 128 bytes of codes (byte 32c + 4j + i holds input 4c + i
// of column j in its low nibble and input 16 + 4c + i in its high one), then the eight columns'
// float16 scales, then their float16 offsets. Eight products of a code (<= 15) and an activation
// (|q| <= 127) pair-summed stay within int16 (8 * 2 * 15 * 127 = 30480), so a block's int16 sums
// need one widening.
// The activations a tile's code bytes 32c..32c+31 meet in one block (`qb`: the row's 32 codes of
// it): inputs 4c..4c+3 (the low nibbles) and 16+4c..16+4c+3 (the high ones), each four as one
// int32 to broadcast.
struct Quads {
  int32_t lo, hi;
};
inline Quads quads(const int8_t* qb, int c) {
  Quads a;
  std::memcpy(&a.lo, qb + 4 * c, 4);
  std::memcpy(&a.hi, qb + 16 + 4 * c, 4);
  return a;
}

template <Isa I, int R, typename O>
inline void int4_tile_rows(const uint8_t* __restrict tile, int64_t blocks, const int8_t* __restrict q,
                           const float* __restrict qs, const float* __restrict qsum, int64_t K,
                           O* __restrict out, int64_t out_stride, int64_t cols) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = tile + b * kTileRecord;
    for (int line = 0; line < kTileRecord; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kTilePrefetch + line), _MM_HINT_T0);
    __m256i isum[R];
    for (int j = 0; j < R; ++j) isum[j] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * c));
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      for (int j = 0; j < R; ++j) {
        const Quads a = quads(q + j * K + b * 32, c);
        isum[j] = accumulate<I>(isum[j], lo, _mm256_set1_epi32(a.lo));
        isum[j] = accumulate<I>(isum[j], hi, _mm256_set1_epi32(a.hi));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 128)));
    const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 144)));
    for (int j = 0; j < R; ++j) {
      const __m256 sums = _mm256_cvtepi32_ps(widen<I>(isum[j]));
      acc[j] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_set1_ps(qs[j * blocks + b])), acc[j]);
      acc[j] = _mm256_fmadd_ps(o, _mm256_set1_ps(qsum[j * blocks + b]), acc[j]);
    }
  }
  for (int j = 0; j < R; ++j) store8(out + j * out_stride, acc[j], cols);
}

#ifdef SLOSERVE_VNNI512
// Two tiles side by side (16 columns) in 512-bit registers: each activation broadcast and each
// instruction serves twice the columns. Every lane does int4_tile_rows's arithmetic in its order,
// so the outputs are the same bits. `cols`: 9-16 (the second tile may be the partial last one).
template <int R, typename O>
inline void int4_tile_pair_rows(const uint8_t* __restrict tile_a, const uint8_t* __restrict tile_b, int64_t blocks,
                                const int8_t* __restrict q, const float* __restrict qs, const float* __restrict qsum,
                                int64_t K, O* __restrict out, int64_t out_stride, int64_t cols) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* ra = tile_a + b * kTileRecord;
    const uint8_t* rb = tile_b + b * kTileRecord;
    for (int line = 0; line < kTileRecord; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ra + kTilePrefetch + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(rb + kTilePrefetch + line), _MM_HINT_T0);
    }
    __m512i isum[R];
    for (int j = 0; j < R; ++j) isum[j] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i packed = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ra + 32 * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rb + 32 * c)), 1);
      const __m512i lo = _mm512_and_si512(packed, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      for (int j = 0; j < R; ++j) {
        const Quads a = quads(q + j * K + b * 32, c);
        isum[j] = _mm512_dpbusd_epi32(isum[j], lo, _mm512_set1_epi32(a.lo));
        isum[j] = _mm512_dpbusd_epi32(isum[j], hi, _mm512_set1_epi32(a.hi));
      }
    }
    auto halves = [](const uint8_t* a, const uint8_t* b) {
      return _mm512_insertf32x8(
          _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), 1);
    };
    const __m512 d = halves(ra + 128, rb + 128);
    const __m512 o = halves(ra + 144, rb + 144);
    for (int j = 0; j < R; ++j) {
      const __m512 sums = _mm512_cvtepi32_ps(isum[j]);
      acc[j] = _mm512_fmadd_ps(sums, _mm512_mul_ps(d, _mm512_set1_ps(qs[j * blocks + b])), acc[j]);
      acc[j] = _mm512_fmadd_ps(o, _mm512_set1_ps(qsum[j * blocks + b]), acc[j]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int j = 0; j < R; ++j) store16(out + j * out_stride, acc[j], keep);
}

// W8A8 over sixteen output columns side by side (quant.w8a8_tiles): the column kernel above sums
// each (row, column) pair horizontally, which a step of many rows pays for every output; here one
// vpdpbusd multiplies four inputs of all sixteen columns by the same four activations (broadcast)
// and a block's sixteen int32 sums come out in one vector. vpdpbusd wants one factor unsigned:
// the activations go in as q + 128 (the xor of their sign bit), and each tile block's record
// starts its sums at -128 * (the column's codes summed over the block), so the integer sums are
// exactly sum(code * q). Per block, the sums are scaled by the row's activation scale; the
// columns' scales multiply once at the end.
template <int R, typename O>
inline void int8_tile16_rows(const int8_t* __restrict tile, const int32_t* __restrict start, int64_t blocks,
                             const uint8_t* __restrict q, const float* __restrict qs, int64_t K,
                             O* __restrict out, int64_t out_stride, __m512 column_scale, int64_t cols) {
  __m512 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* rec = tile + b * kInt8TileBytes;
    for (int line = 0; line < kInt8TileBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * kInt8TileBytes + line), _MM_HINT_T0);
    const __m512i s0 = _mm512_loadu_si512(start + b * 16);
    __m512i isum[R];
    for (int j = 0; j < R; ++j) isum[j] = s0;
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * c);
      for (int j = 0; j < R; ++j) {
        int32_t a;  // four activations, as q + 128
        std::memcpy(&a, q + j * K + b * 32 + 4 * c, 4);
        isum[j] = _mm512_dpbusd_epi32(isum[j], _mm512_set1_epi32(a), w);
      }
    }
    for (int j = 0; j < R; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_set1_ps(qs[j * blocks + b]), acc[j]);
  }
  const __mmask16 keep = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  for (int j = 0; j < R; ++j) store16(out + j * out_stride, _mm512_mul_ps(acc[j], column_scale), keep);
}
#endif
#endif

}  // namespace

bool int8_gemv_supported() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

std::vector<std::string> int8_kernel_isas() {
  std::vector<std::string> out;
  if (!int8_gemv_supported()) return out;
#ifdef SLOSERVE_VNNI
  out.push_back("vnni");
#endif
  out.push_back("avx2");
  return out;
}

void check_int8_isa(const std::string& isa) {
  const std::vector<std::string> have = int8_kernel_isas();
  TORCH_CHECK(isa == "auto" || std::find(have.begin(), have.end(), isa) != have.end(), "unknown or unavailable ",
              "int8 kernel ISA '", isa, "' (auto, or one of this build's: ", c10::Join(", ", have), ")");
}

namespace {

// Called for every product (a decode step makes ~120): string compares only, no list built.
Isa resolve_isa(const std::string& isa) {
#ifdef SLOSERVE_VNNI
  if (isa == "auto" || isa == "vnni") return Isa::vnni;
#else
  if (isa == "auto") return Isa::avx2;
#endif
  if (isa != "avx2") check_int8_isa(isa);  // fails, naming what this build has
  return Isa::avx2;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Calls body(std::integral_constant<Isa, I>{}) with the resolved ISA as a compile-time value.
template <typename Body>
void with_isa(Isa isa, Body&& body) {
#ifdef SLOSERVE_VNNI
  if (isa == Isa::vnni) return body(std::integral_constant<Isa, Isa::vnni>{});
#endif
  body(std::integral_constant<Isa, Isa::avx2>{});
}
#endif

}  // namespace

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& weight_scale,
                     const std::string& isa) {
  TORCH_CHECK(int8_gemv_supported(), "int8_gemv: this build has no AVX2");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() == codes.size(0),
              "int8_gemv: x [M, K], codes [N, K] int8, weight_scale [N] float32 expected");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "int8_gemv: K must match and be a multiple of 32, got ", K);
  const Isa chosen = resolve_isa(isa);
  auto out = at::empty({M, N}, x.options().dtype(x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat));
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const int64_t blocks = K / 32;
  const Int8Rows xq8 = quantize_rows(x, false);
  const auto& xq = xq8.q;
  const auto& xs = xq8.scale;
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* ws = weight_scale.data_ptr<float>();
  with_output(out, [&](auto* op) {
  with_isa(chosen, [&](auto isa_tag) {
    constexpr Isa I = decltype(isa_tag)::value;
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      constexpr int R0 = 4;
      for (int64_t n = begin; n < end; ++n)
        for (int64_t m0 = 0; m0 < M; m0 += R0) {
          const int8_t* qm = xq.data() + m0 * K;
          const float* sm = xs.data() + m0 * blocks;
          auto* o = op + m0 * N + n;
          with_rows<R0>(std::min<int64_t>(R0, M - m0), [&](auto rows) {
            int8_rows<I, decltype(rows)::value>(w + n * K, ws[n], K, blocks, qm, sm, o, N);
          });
        }
    });
  });
  });
#endif
  return out;
}

bool int8_tiles_supported() {
#if defined(SLOSERVE_VNNI512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

at::Tensor int8_tile_gemm(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& starts,
                          const at::Tensor& weight_scale, int64_t N) {
  TORCH_CHECK(int8_tiles_supported(), "int8_tile_gemm: this build has no AVX512-VNNI (BW, DQ, VL)");
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() &&
                  tiles.size(0) == (N + 15) / 16 && tiles.size(2) == kInt8TileBytes && starts.is_contiguous() &&
                  starts.scalar_type() == at::kInt && starts.numel() == tiles.size(0) * tiles.size(1) * 16 &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() >= N,
              "int8_tile_gemm: x [M, K], tiles [ceil(N / 16), K / 32, 512] int8, starts [ceil(N / 16), K / 32, 16] "
              "int32 and weight_scale [N] float32 expected");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  TORCH_CHECK(K % 32 == 0 && tiles.size(1) == blocks, "int8_tile_gemm: K must match and be a multiple of 32, got ", K);
  auto out = at::empty({M, N}, x.options().dtype(x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat));
#if defined(SLOSERVE_VNNI512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  Int8Rows xq = quantize_rows(x, false);
  // q + 128: vpdpbusd's unsigned factor (flipping the sign bit here, once, keeps the kernel's
  // broadcasts straight from memory)
  uint8_t* qu = reinterpret_cast<uint8_t*>(xq.q.data());
  for (int64_t i = 0; i < M * K; ++i) qu[i] ^= 0x80u;
  const int8_t* w = tiles.data_ptr<int8_t>();
  const int32_t* st = starts.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const int64_t count = tiles.size(0);
  with_output(out, [&](auto* op) {
  at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
    constexpr int R0 = 8;
    for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {  // a chunk of rows through all this thread's tiles
      const int64_t r1 = std::min<int64_t>(M, r0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t cols = std::min<int64_t>(16, N - 16 * t);
        const __m512 column_scale = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), ws + 16 * t);
        for (int64_t m0 = r0; m0 < r1; m0 += R0)
          with_rows<R0>(std::min<int64_t>(R0, r1 - m0), [&](auto rows) {
            int8_tile16_rows<decltype(rows)::value>(w + t * blocks * kInt8TileBytes, st + t * blocks * 16, blocks,
                                                   qu + m0 * K, xq.scale.data() + m0 * blocks, K,
                                                   op + m0 * N + 16 * t, N, column_scale, cols);
          });
      }
    }
  });
  });
#endif
  return out;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& tiles, int64_t N, const std::string& isa) {
  TORCH_CHECK(int8_gemv_supported(), "int4_gemv: this build has no AVX2");
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(2) == kTileRecord && tiles.size(0) == (N + 7) / 8,
              "int4_gemv: x [M, K] and tiles [ceil(N / 8), K / 32, 160] uint8 expected");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  TORCH_CHECK(K % 32 == 0 && tiles.size(1) == blocks, "int4_gemv: K must match and be a multiple of 32, got ", K);
  const Isa chosen = resolve_isa(isa);
  auto out = at::empty({M, N}, x.options().dtype(x.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat));
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const Int8Rows xq = quantize_rows(x, true);
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const int8_t* q = xq.q.data();
  const float* qs = xq.scale.data();
  const float* qsum = xq.scaled_sum.data();
  with_output(out, [&](auto* op) {
  with_isa(chosen, [&](auto isa_tag) {
    constexpr Isa I = decltype(isa_tag)::value;
    // VNNI with AVX-512BW/DQ takes the tiles two at a time once a step has kPairRows rows; threads
    // get whole pairs. Measured on a Zen4 EPYC over 30 layers' weights (streamed from memory), one
    // at a time against two, alternating in one process: 16 / 64 / 256 rows 1.08x / 1.27x / 1.33x
    // faster in pairs, but 1 and 4 rows 0.70x / 0.78x: a memory-bound step streams best one tile
    // at a time. Engine decode steps (6 rounds): 16 streams level, 32 streams 1.08x.
#ifdef SLOSERVE_VNNI512
    const bool pairs = I == Isa::vnni && M >= kPairRows;
#else
    constexpr bool pairs = false;
#endif
    const int64_t units = pairs ? (tiles.size(0) + 1) / 2 : tiles.size(0);
    at::parallel_for(0, units, pairs ? 2 : 4, [&](int64_t ubegin, int64_t uend) {
      const int64_t begin = pairs ? 2 * ubegin : ubegin;
      const int64_t end = std::min<int64_t>(tiles.size(0), pairs ? 2 * uend : uend);
      constexpr int R0 = int4_max_rows<I>();
      // A prefill's rows in chunks, each chunk through all of this thread's tiles: the chunk's
      // activations stay in L1/L2 while the tiles come round again, instead of every tile
      // streaming all rows' activations (the layers at 2,048 rows ~1.12x faster on a Zen4 EPYC,
      // equal at 512).
      for (int64_t r0 = 0; r0 < M; r0 += kRowChunk) {
        const int64_t r1 = std::min<int64_t>(M, r0 + kRowChunk);
        for (int64_t t = begin; t < end; t += pairs ? 2 : 1) {
          const uint8_t* tile = w + t * blocks * kTileRecord;
          const int64_t cols = std::min<int64_t>(pairs && t + 1 < end ? 16 : 8, N - 8 * t);
          for (int64_t m0 = r0; m0 < r1; m0 += R0) {
            const int8_t* qm = q + m0 * K;
            const float *sm = qs + m0 * blocks, *tm = qsum + m0 * blocks;
            auto* o = op + m0 * N + 8 * t;
            with_rows<R0>(std::min<int64_t>(R0, r1 - m0), [&](auto rows) {
              constexpr int R = decltype(rows)::value;
#ifdef SLOSERVE_VNNI512
              if (cols > 8) return int4_tile_pair_rows<R>(tile, tile + blocks * kTileRecord, blocks, qm, sm, tm, K, o,
                                                          N, cols);
#endif
              int4_tile_rows<I, R>(tile, blocks, qm, sm, tm, K, o, N, cols);
            });
          }
        }
      }
    });
  });
  });
#endif
  return out;
}

}  // namespace sloserve
