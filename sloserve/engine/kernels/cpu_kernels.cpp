// Python bindings of sloserve's native CPU kernels (kernels.h); compiled on first use
// (sloserve/engine/kernels/__init__.py).
#include <torch/extension.h>

#include "kernels.h"

using namespace sloserve;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("context_lens"), pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("kernel") = "auto", no_gil);
  m.def("attention_kernels", &attention_kernels, "the bf16 attention paths this machine offers, fastest first");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", no_gil);
  m.def("rope_", &rope_, "rotary embedding in place", no_gil);
  m.def("prefill_attention", &prefill_attention, "causal prefill attention over a paged KV cache",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("spans"), pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("window"),
        pybind11::arg("out"), pybind11::arg("kernel") = "auto", no_gil);
  m.def("write_kv_", &write_kv_, "store the new tokens' K and V into a layer's paged cache", no_gil);
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties)", no_gil);
  m.def("quantize_rows_u8", &quantize_rows_u8, "W8A8 activations: each row to int8 by its own scale, + 128", no_gil);
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "structured outputs: -inf where a row's bitmask disallows",
        pybind11::arg("logits"), pybind11::arg("bitmask"), pybind11::arg("rows"), pybind11::arg("vocab"), no_gil);
  m.def("int8_gemv_supported", &int8_gemv_supported, "whether this build has the W8A8 product (AVX2)");
  m.def("int8_kernel_isas", &int8_kernel_isas, "the ISAs of the int8 products this build has, fastest first");
  m.def("int8_gemv", &int8_gemv, "x W^T with int8 weights and per-32-block int8 activations", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("weight_scale"), pybind11::arg("isa") = "auto", no_gil);
  m.def("int8_tiles_supported", &int8_tiles_supported, "whether this build has the tiled W8A8 product (VNNI-512)");
  m.def("int8_tile_gemm", &int8_tile_gemm, "x W^T with int8 weights in 16-column tiles and int8 activations",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("starts"), pybind11::arg("weight_scale"),
        pybind11::arg("N"), no_gil);
  m.def("int4_gemv", &int4_gemv, "x W^T with group-affine 4-bit weights and per-32-block int8 activations",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("N"), pybind11::arg("isa") = "auto", no_gil);
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a decode-only step through every layer in one call")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                          int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("bind_cache", &DecodeStack::bind_cache)
      .def("use_int8_isa", &DecodeStack::use_int8_isa)
      .def("forward", &DecodeStack::forward, no_gil);
}
