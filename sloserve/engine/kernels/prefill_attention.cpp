// Prefill attention over the paged KV cache: each prefill chunk's queries attend causally to the
// cached prefix and the chunk itself.
#include "kernels.h"

#include "common.h"

namespace sloserve {
namespace {

// A unit of work: 16 queries of one chunk and query head; its cost, the keys it visits.
struct PrefillTask {
  int64_t span, head, qblock, cost;
};

// One call's tensors, unpacked once for either kernel (bf16 values as their bits).
struct PrefillCall {
  int64_t nh, hd, nkv, group, S, W, block_size;
  int64_t kv_row;  // cache elements between positions
  int64_t q_row;   // q may be a view into the fused QKV output
  const int64_t* sp;  // [S, 3]: first row in q, rows, start position
  const int64_t* bt;  // [S, W] block tables
  const uint16_t *k, *v, *q;
  c10::BFloat16* out;

  PrefillCall(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& spans, int64_t block_size_, at::Tensor& out_)
      : nh(q_.size(1)), hd(q_.size(2)), nkv(k_cache.size(1)), group(nh / nkv), S(spans.size(0)), W(tables.size(1)),
        block_size(block_size_), kv_row(nkv * hd), q_row(q_.stride(0)), sp(spans.data_ptr<int64_t>()),
        bt(tables.data_ptr<int64_t>()), k(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>())),
        v(reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>())),
        q(reinterpret_cast<const uint16_t*>(q_.data_ptr<c10::BFloat16>())), out(out_.data_ptr<c10::BFloat16>()) {}

  int64_t slot(int64_t s, int64_t pos) const { return bt[s * W + pos / block_size] * block_size + pos % block_size; }

  // The tasks, each costed by cost(last key, first key) in the kernel's own units; fills `costs`.
  template <typename Cost>
  std::vector<PrefillTask> tasks(int64_t window, const Cost& cost, std::vector<int64_t>& costs) const {
    std::vector<PrefillTask> out_tasks;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n = sp[3 * s + 1], start = sp[3 * s + 2];
      for (int64_t qb = 0; qb * 16 < n; ++qb) {
        const int64_t last = start + std::min(n, (qb + 1) * 16) - 1;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, start + qb * 16 - window + 1) : 0;
        for (int64_t h = 0; h < nh; ++h) out_tasks.push_back({s, h, qb, cost(last, lo)});
      }
    }
    costs.resize(out_tasks.size());
    for (size_t t = 0; t < out_tasks.size(); ++t) costs[t] = out_tasks[t].cost;
    return out_tasks;
  }
};

#ifdef SLOSERVE_AVX512BF16
// The permutation [a0..a15 | b0..b15] (16-bit) -> a0 b0 a1 b1 ...: two keys' probabilities pair-interleaved.
inline __m512i pair_interleave_index() {
  return _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006,
                           0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B, 0x001C000C, 0x001D000D,
                           0x001E000E, 0x001F000F);
}
#endif

#ifdef SLOSERVE_AMX
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

void prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& spans, int64_t block_size, float scale,
                           int64_t window, at::Tensor& out) {
  const PrefillCall c(q, k_cache, v_cache, tables, spans, block_size, out);
  const int64_t nh = c.nh, hd = c.hd, nkv = c.nkv, group = c.group, S = c.S, kv_row = c.kv_row, q_row = c.q_row;
  const int64_t* sp = c.sp;
  const auto* kp = reinterpret_cast<const char*>(c.k);
  const uint16_t *vp = c.v, *qp = c.q;
  auto* op = c.out;
  auto slot = [&](int64_t s, int64_t pos) { return c.slot(s, pos); };

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
  std::vector<int64_t> costs;
  const auto tasks = c.tasks(window, [](int64_t last, int64_t lo) { return last / KEYS - lo / KEYS + 2; }, costs);

  // 3. flash attention per task
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pair_idx = pair_interleave_index();
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
#endif  // SLOSERVE_AMX

#ifdef SLOSERVE_AVX512BF16
// ---------------------------------------------------------------- prefill attention, AVX512-BF16
//
// For CPUs with AVX512-BF16 but no AMX (AMD Zen4), where torch's flash attention per chunk ran
// at ~100 GFLOP/s and was ~40% of a prefill step. Per (chunk, query head, 16 queries), with the
// transposed layout of the AMX path so each key's 16 query scores fill one vector:
//   1. S^T[key] = sum over dim pairs of vdpbf16ps(Q^T pair row, the key's dim pair broadcast),
//      four keys at a time (four accumulator chains, one Q^T load per four products);
//   2. exact softmax per query lane over all the visited keys (two passes: the scores of a
//      ShareGPT-sized context stay in cache), probabilities rounded to bf16 and pair-interleaved by
//      key;
//   3. O[query][dims] += the probability pair broadcast times V's key pairs (interleaved once per
//      chunk and KV head, shared by its query heads), 8 queries x 32 dims of accumulators.

struct VecPrefillScratch {
  std::vector<int32_t, AlignedAllocator<int32_t>> qt;  // Q^T [hd / 2][16]: each query's dim pair
  std::vector<float, AlignedAllocator<float>> st;      // S^T [keys][16]
  std::vector<int32_t, AlignedAllocator<int32_t>> pt;  // P^T [key pairs][16]: each query's key pair (bf16 x 2)
};

void prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& tables, const at::Tensor& spans, int64_t block_size, float scale,
                            int64_t window, at::Tensor& out) {
  const PrefillCall c(q, k_cache, v_cache, tables, spans, block_size, out);
  const int64_t nh = c.nh, hd = c.hd, nkv = c.nkv, group = c.group, S = c.S, kv_row = c.kv_row, q_row = c.q_row;
  const int64_t* sp = c.sp;
  const uint16_t *kp = c.k, *vp = c.v, *qp = c.q;
  auto* op = c.out;
  auto slot = [&](int64_t s, int64_t pos) { return c.slot(s, pos); };

  // 1. V pair-interleaved per (chunk, absolute key pair, KV head): [hd dims][2 keys], zero past the context
  std::vector<int64_t> first_pair(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) first_pair[s + 1] = first_pair[s] + (sp[3 * s + 2] + sp[3 * s + 1] + 1) / 2;
  const int64_t pair_elems = 2 * hd;
  std::vector<uint16_t, AlignedAllocator<uint16_t>> vi(first_pair[S] * nkv * pair_elems);
  at::parallel_for(0, first_pair[S], 16, [&](int64_t begin, int64_t end) {
    for (int64_t gp = begin; gp < end; ++gp) {
      const int64_t s = std::upper_bound(first_pair.begin(), first_pair.end(), gp) - first_pair.begin() - 1;
      const int64_t pos = 2 * (gp - first_pair[s]), ctx = sp[3 * s + 2] + sp[3 * s + 1];
      const uint16_t* a = vp + slot(s, pos) * kv_row;
      const uint16_t* b = pos + 1 < ctx ? vp + slot(s, pos + 1) * kv_row : nullptr;
      for (int64_t g = 0; g < nkv; ++g)
        for (int64_t c = 0; c < hd / 32; ++c)
          interleave32(a + g * hd + 32 * c, b ? b + g * hd + 32 * c : nullptr,
                       vi.data() + (gp * nkv + g) * pair_elems + 64 * c);
    }
  });

  // 2. tasks: (chunk, query head, 16 queries), costed by the keys they visit
  std::vector<int64_t> costs;
  const auto tasks = c.tasks(window, [](int64_t last, int64_t lo) { return last - lo + 8; }, costs);

  // 3. attention per task
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i pair_idx = pair_interleave_index();
  parallel_balanced(costs, [&](int64_t tb, int64_t te) {
    VecPrefillScratch w;
    w.qt.resize(hd / 2 * 16);
    for (int64_t ti = tb; ti < te; ++ti) {
      const PrefillTask& t = tasks[ti];
      const int64_t row0 = sp[3 * t.span], n = sp[3 * t.span + 1], start = sp[3 * t.span + 2];
      const int64_t g = t.head / group, q0 = t.qblock * 16, rows = std::min<int64_t>(16, n - q0);
      const int64_t last = start + q0 + rows - 1;  // the block's last query position
      // from an even key (pairs are absolute); a key before the window is masked like any other
      const int64_t lo = (window > 0 ? std::max<int64_t>(0, start + q0 - window + 1) : 0) & ~int64_t(1);
      const int64_t keys = last - lo + 1, pairs = (keys + 1) / 2;
      const __mmask16 qvalid = static_cast<__mmask16>((1u << rows) - 1);
      const __m512i qpos = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(start + q0)));
      const __m512i qfloor = _mm512_sub_epi32(qpos, _mm512_set1_epi32(static_cast<int>(window)));
      // Q^T: qt[i][r] = q[r][2 i], q[r][2 i + 1]
      std::fill(w.qt.begin(), w.qt.end(), 0);
      for (int64_t r = 0; r < rows; ++r) {
        const auto* qr = reinterpret_cast<const int32_t*>(qp + (row0 + q0 + r) * q_row + t.head * hd);
        for (int64_t i = 0; i < hd / 2; ++i) w.qt[i * 16 + r] = qr[i];
      }
      w.st.resize(2 * pairs * 16);
      __m512 m = ninf;
      for (int64_t k = lo; k <= last; k += 4) {
        const int64_t kk = std::min<int64_t>(4, last + 1 - k);
        const int32_t* kr[4];
        for (int64_t u = 0; u < 4; ++u)
          kr[u] = reinterpret_cast<const int32_t*>(kp + slot(t.span, k + std::min(u, kk - 1)) * kv_row + g * hd);
        // four accumulator chains in registers (an indexed array of them was spilled to the stack)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < hd / 2; ++i) {
          const __m512i qv = _mm512_load_si512(w.qt.data() + i * 16);
          a0 = dot_pairs(a0, qv, _mm512_set1_epi32(kr[0][i]));
          a1 = dot_pairs(a1, qv, _mm512_set1_epi32(kr[1][i]));
          a2 = dot_pairs(a2, qv, _mm512_set1_epi32(kr[2][i]));
          a3 = dot_pairs(a3, qv, _mm512_set1_epi32(kr[3][i]));
        }
        const __m512 acc[4] = {a0, a1, a2, a3};
        for (int64_t u = 0; u < kk; ++u) {
          const __m512i kv = _mm512_set1_epi32(static_cast<int>(k + u));
          __mmask16 keep = qvalid & _mm512_cmp_epi32_mask(kv, qpos, _MM_CMPINT_LE);
          if (window > 0) keep &= _mm512_cmp_epi32_mask(kv, qfloor, _MM_CMPINT_NLE);
          const __m512 x = _mm512_mask_mul_ps(ninf, keep, acc[u], _mm512_set1_ps(scale));
          _mm512_store_ps(w.st.data() + (k + u - lo) * 16, x);
          m = _mm512_max_ps(m, x);
        }
      }
      if (keys % 2) _mm512_store_ps(w.st.data() + keys * 16, ninf);
      // probabilities: a lane's masked keys (-inf) give 0, and so does every key of a lane past the rows
      __m512 l = _mm512_setzero_ps();
      w.pt.resize(pairs * 16);
      for (int64_t p = 0; p < pairs; ++p) {
        const __m512 s0 = _mm512_load_ps(w.st.data() + 2 * p * 16), s1 = _mm512_load_ps(w.st.data() + (2 * p + 1) * 16);
        const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_OQ), fast_exp16(_mm512_sub_ps(s0, m)));
        const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_OQ), fast_exp16(_mm512_sub_ps(s1, m)));
        l = _mm512_add_ps(l, _mm512_add_ps(e0, e1));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0 in the low half
        _mm512_store_si512(w.pt.data() + p * 16, _mm512_permutexvar_epi16(pair_idx, both));
      }
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(1.f), l));
      // O = P V, 8 queries x 32 dims of accumulators at a time
      const uint16_t* vbase = vi.data() + ((first_pair[t.span] + lo / 2) * nkv + g) * pair_elems;
      for (int64_t qb = 0; qb < rows; qb += 8) {
        const int64_t nq = std::min<int64_t>(8, rows - qb);
        for (int64_t db = 0; db < hd; db += 32) {
          __m512 o[8][2];
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) o[u][0] = o[u][1] = _mm512_setzero_ps();
          for (int64_t p = 0; p < pairs; ++p) {
            const uint16_t* vpair = vbase + p * nkv * pair_elems + 2 * db;
            const __m512i v0 = _mm512_load_si512(vpair), v1 = _mm512_load_si512(vpair + 32);
            const int32_t* pp = w.pt.data() + p * 16 + qb;
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) {
              const __m512i pr = _mm512_set1_epi32(pp[u]);
              o[u][0] = dot_pairs(o[u][0], v0, pr);
              o[u][1] = dot_pairs(o[u][1], v1, pr);
            }
          }
#pragma GCC unroll 8
          for (int64_t u = 0; u < 8; ++u) {
            if (u >= nq) break;
            const int64_t r = qb + u;
            auto* dst = reinterpret_cast<uint16_t*>(op + ((row0 + q0 + r) * nh + t.head) * hd + db);
            const __m512 scale_r = _mm512_set1_ps(inv[r]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[u][0], scale_r)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[u][1], scale_r)));
          }
        }
      }
    }
  });
}
#endif  // SLOSERVE_AVX512BF16

}  // namespace

// Prefill chunks' causal attention to their context in the paged cache, written into `out`'s
// rows of the chunks; false (nothing written) when no native path of this build takes these
// tensors (the caller then runs SDPA per chunk). spans [S, 3] int64: first row in q, rows, start
// position (tokens of the sequence cached before the chunk); block_tables [S, W]. `kernel`:
// "auto" (the fastest that serves), or one of attention_kernels() ("portable": always false).
bool prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& spans, int64_t block_size, double scale,
                       int64_t window, at::Tensor& out, const std::string& kernel) {
  check_kernel_name(kernel);
  const bool bf16 = q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                    v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16;
  if (!bf16 || kernel == "portable") return false;
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "prefill_attention: q [T, nh, hd] with dense rows expected");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && spans.is_contiguous(), "prefill_attention: contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
              spans.size(1) == 3 && block_tables.size(0) == spans.size(0), "prefill_attention: bad spans or tables");
  [[maybe_unused]] const float s = static_cast<float>(scale);
#ifdef SLOSERVE_AMX
  if ((kernel == "auto" || kernel == "amx") && amx_serves(q, k_cache, block_size) && q.size(2) <= 128) {
    prefill_attention_amx(q, k_cache, v_cache, block_tables, spans, block_size, s, window, out);
    return true;
  }
#endif
#ifdef SLOSERVE_AVX512BF16
  if ((kernel == "auto" || kernel == "avx512_bf16") && q.size(2) % 32 == 0) {
    prefill_attention_bf16(q, k_cache, v_cache, block_tables, spans, block_size, s, window, out);
    return true;
  }
#endif
  TORCH_CHECK(kernel == "auto", "prefill_attention: the ", kernel, " kernel cannot take these tensors here");
  return false;
}

}  // namespace sloserve
