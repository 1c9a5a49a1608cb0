// A decode step through every decoder layer in one call. LlamaModel.forward's native path crosses
// from Python into C++ about a dozen times a layer (norms, the 4-bit products, RoPE, the KV write,
// attention); each crossing costs argument conversion and interpreter time, ~2 ms of a ~9 ms token
// for the embedded model on a 2-core EPYC. This runs the same kernels in the same order from C++,
// so its numbers are the Python loop's exactly (tests/test_quant.py compares them bit for bit).
#include "kernels.h"

namespace sloserve {

DecodeStack::DecodeStack(std::vector<at::Tensor> in_norm, std::vector<at::Tensor> post_norm,
                         std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
                         std::vector<at::Tensor> down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t hidden, int64_t intermediate, double eps, double scale, int64_t window)
    : in_norm_(std::move(in_norm)), post_norm_(std::move(post_norm)), qkv_(std::move(qkv)), o_(std::move(o)),
      gate_up_(std::move(gate_up)), down_(std::move(down)), nh_(num_heads), nkv_(num_kv_heads), hd_(head_dim),
      hidden_(hidden), intermediate_(intermediate), eps_(eps), scale_(scale), window_(window) {
  const size_t n = in_norm_.size();
  TORCH_CHECK(post_norm_.size() == n && qkv_.size() == n && o_.size() == n && gate_up_.size() == n &&
                  down_.size() == n,
              "DecodeStack: one of each weight per layer expected");
}

void DecodeStack::bind_cache(std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t block_size,
                             const std::string& kernel) {
  TORCH_CHECK(k_caches.size() == in_norm_.size() && v_caches.size() == in_norm_.size(),
              "DecodeStack: one K and one V cache per layer expected");
  check_kernel_name(kernel);
  k_caches_ = std::move(k_caches);
  v_caches_ = std::move(v_caches);
  block_size_ = block_size;
  kernel_ = kernel;
}

void DecodeStack::use_int8_isa(const std::string& isa) {
  check_int8_isa(isa);
  int8_isa_ = isa;
}

at::Tensor DecodeStack::forward(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens) const {
  TORCH_CHECK(!k_caches_.empty() || in_norm_.empty(), "DecodeStack: no KV cache bound");
  const int64_t T = h.size(0), q_size = nh_ * hd_, kv_size = nkv_ * hd_;
  const auto dtype = h.scalar_type();
  auto linear = [&](const at::Tensor& x, const at::Tensor& tiles, int64_t n) {
    at::Tensor y = int4_gemv(x, tiles, n, int8_isa_);  // in x's dtype for bf16, float32 otherwise
    return y.scalar_type() == dtype ? y : y.to(dtype);
  };
  at::Tensor delta;  // the previous layer's MLP output, not yet added to h
  for (size_t li = 0; li < in_norm_.size(); ++li) {
    at::Tensor x = delta.defined() ? add_rms_norm(h, delta, in_norm_[li], eps_) : rms_norm(h, in_norm_[li], eps_);
    at::Tensor qkv = linear(x, qkv_[li], q_size + 2 * kv_size);
    at::Tensor heads = qkv.view({T, nh_ + 2 * nkv_, hd_});
    rope_(heads, cos, sin, nh_ + nkv_);  // Q and K heads side by side: one call rotates both
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, nh_, hd_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, nkv_, hd_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, nkv_, hd_});
    at::Tensor k_cache = k_caches_[li], v_cache = v_caches_[li];  // handles: the write goes to their storage
    write_kv_(k_cache, v_cache, slots, k, v);
    const at::Tensor attn = paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, context_lens,
                                                   block_size_, scale_, window_, kernel_);
    x = add_rms_norm(h, linear(attn.view({T, q_size}), o_[li], hidden_), post_norm_[li], eps_);
    delta = linear(silu_and_mul(linear(x, gate_up_[li], 2 * intermediate_)), down_[li], hidden_);
  }
  return delta.defined() ? h + delta : h;
}

}  // namespace sloserve
