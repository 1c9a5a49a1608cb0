// The entry points of sloserve's native CPU kernels (float32, bfloat16 or float16 tensors), one
// source file per kind of work; cpu_kernels.cpp binds them to Python.
//
// Arithmetic is in float32 whatever the tensors' type (bf16 products accumulate in float32).
// 16-bit values are converted by bit operations rather than c10's scalar conversions, so the
// loops vectorize.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace sloserve {

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q,             // [D, nh, hd]
                                  const at::Tensor& k_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                  const at::Tensor& v_cache,       // [slots, nkv, hd] (int8: hd + 4)
                                  const at::Tensor& block_tables,  // [D, W] int64
                                  const at::Tensor& context_lens,  // [D] int64
                                  int64_t block_size, double scale, int64_t window, const std::string& kernel);
// The bf16 attention paths this build and CPU offer, fastest first: "amx" (AMX tiles, prefill and
// decode), "avx512_bf16" (vdpbf16ps prefill and decode), "portable" (the
// float32 vector loop for decode; for prefill, SDPA by the caller).
std::vector<std::string> attention_kernels();
// Fails with a clear message on an unknown name or one this machine lacks ("auto" always passes).
void check_kernel_name(const std::string& kernel);

// prefill_attention.cpp
bool prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& spans, int64_t block_size, double scale,
                       int64_t window, at::Tensor& out, const std::string& kernel);

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads);
// K and V [T, heads, dim] of the new tokens into one layer's caches [slots, heads, dim] at `slots`
// (same dtype; rows of k and v may be strided, as views of the fused qkv output are).
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v);
at::Tensor argmax_rows(const at::Tensor& logits);
// Per-row int8 activations for oneDNN's u8 x s8 GEMM: (codes + 128 as uint8 [M, K], scales float32 [M, 1]).
std::vector<at::Tensor> quantize_rows_u8(const at::Tensor& x);
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows, int64_t vocab);

// int8_gemv.cpp: products with int8 activations for few rows (W8A8: the LM head of a small decode
// step; W4A8: the 4-bit layers); both need AVX2. `isa`: "auto" (the fastest this build has),
// "vnni" (AVX512-VNNI's vpdpbusd) or "avx2"; every choice gives the same bits. Each returns its
// output in x's type for bf16 x (the float32 sums rounded to nearest even), else float32.
bool int8_gemv_supported();
// The ISAs this build's int8 products can use, fastest first (empty without AVX2).
std::vector<std::string> int8_kernel_isas();
// Fails with the list of this build's ISAs unless `isa` is "auto" or one of them.
void check_int8_isa(const std::string& isa);
at::Tensor int8_gemv(const at::Tensor& x,             // [M, K] float32/bf16, K a multiple of 32
                     const at::Tensor& codes,         // [N, K] int8 in [-127, 127]
                     const at::Tensor& weight_scale,  // [N] float32; returns [M, N]
                     const std::string& isa = "auto");
// W8A8 for many rows (AVX512-VNNI with BW/DQ/VL): sixteen columns side by side, quant.w8a8_tiles's
// layout (the same codes and scales as int8_gemv's; its own order of the float sums).
bool int8_tiles_supported();
at::Tensor int8_tile_gemm(const at::Tensor& x,             // [M, K] float32/bf16, K a multiple of 32
                          const at::Tensor& tiles,         // [ceil(N / 16), K / 32, 512] int8
                          const at::Tensor& starts,        // [ceil(N / 16), K / 32, 16] int32
                          const at::Tensor& weight_scale,  // [N] float32; returns [M, N]
                          int64_t N);
at::Tensor int4_gemv(const at::Tensor& x,      // [M, K] float32/bf16, K a multiple of 32
                     const at::Tensor& tiles,  // [ceil(N / 8), K / 32, 160] uint8: quant.w4a8_tiles's layout
                     int64_t N,                // output columns; returns [M, N]
                     const std::string& isa = "auto");

// decode_stack.cpp: a decode-only step through every layer in one call (4-bit W4A8 layers, native
// KV cache and attention), the same kernels in the same order as LlamaModel.forward's loop.
class DecodeStack {
 public:
  DecodeStack(std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm, std::vector<at::Tensor> qkv,
              std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate,
              double eps, double scale, int64_t window);
  // The KV cache the steps write and read: one [slots, nkv, hd] K and V tensor per layer.
  void bind_cache(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t block_size,
                  const std::string& kernel);
  // The ISA of the 4-bit products (int4_gemv's `isa`; "auto" unless a comparison wants another).
  void use_int8_isa(const std::string& isa);
  // h [T, hidden] (the embeddings, updated in place as the residual) -> the last layer's output;
  // cos, sin [T, hd] at the tokens' positions; every row a decode.
  at::Tensor forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& context_lens) const;

 private:
  std::vector<at::Tensor> in_norm_, post_norm_, qkv_, o_, gate_up_, down_, k_caches_, v_caches_;
  int64_t nh_, nkv_, hd_, hidden_, intermediate_;
  double eps_, scale_;
  int64_t window_, block_size_ = 0;
  std::string kernel_ = "auto";
  std::string int8_isa_ = "auto";
};

}  // namespace sloserve
