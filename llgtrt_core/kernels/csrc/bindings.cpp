// Torch bindings of the CUDA kernels: argument checks, dtypes, the current stream.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "masked_sampling.h"
#include "token_bitmask.h"

namespace {

uint32_t negative_infinity_bits(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 0xFF800000u;
    case at::kHalf: return 0xFC00u;
    case at::kBFloat16: return 0xFF80u;
    default: TORCH_CHECK(false, "logits must be float32, float16 or bfloat16, got ", dtype);
  }
}

// The row indices of a mixed batch (mask row j -> logits row rows[j]), as both ops take them.
const int64_t* check_rows(const torch::Tensor& rows, const torch::Tensor& logits) {
  TORCH_CHECK(rows.device() == logits.device() && rows.dim() == 1 && rows.scalar_type() == at::kLong &&
                  rows.is_contiguous(),
              "rows must be a contiguous 1-D int64 tensor on the logits' device");
  return rows.data_ptr<int64_t>();
}

void apply_token_bitmask_inplace(torch::Tensor logits, torch::Tensor bitmask, c10::optional<torch::Tensor> rows,
                                 bool whole_sectors) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "logits must be a 2-D CUDA tensor");
  TORCH_CHECK(bitmask.is_cuda() && bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "bitmask must be a 2-D int32 CUDA tensor with contiguous rows");
  TORCH_CHECK(bitmask.device() == logits.device(), "bitmask and logits are on different devices");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 30) && bitmask.size(1) < (int64_t(1) << 26), "vocab too large");
  const uint32_t fill = negative_infinity_bits(logits.scalar_type());

  llgtrt::BitmaskArgs args{};
  args.logits = logits.data_ptr();
  args.batch = logits.size(0);
  args.row_stride = logits.stride(0);
  args.col_stride = logits.stride(1);
  args.vocab = static_cast<int>(logits.size(1));
  args.bitmask = bitmask.data_ptr<int32_t>();
  args.mask_rows = logits.size(0);
  args.mask_row_stride = bitmask.stride(0);
  args.mask_words = static_cast<int>(bitmask.size(1));
  if (rows.has_value()) {
    args.rows = check_rows(*rows, logits);
    args.mask_rows = rows->numel();
  }
  TORCH_CHECK(bitmask.size(0) == args.mask_rows, "bitmask has ", bitmask.size(0), " rows, expected ", args.mask_rows);

  const c10::cuda::CUDAGuard device_guard(logits.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, logits.get_device()));
  C10_CUDA_CHECK(llgtrt::apply_token_bitmask(args, static_cast<int>(logits.element_size()), fill, whole_sectors, sms,
                                             c10::cuda::getCurrentCUDAStream()));
}

torch::Tensor sample_with_bitmask(torch::Tensor logits, torch::Tensor temperature, torch::Tensor seeds,
                                  c10::optional<torch::Tensor> bitmask, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a 2-D CUDA tensor with contiguous rows");
  TORCH_CHECK(logits.size(1) < (int64_t(1) << 30) && logits.size(0) < 65536, "logits too large");
  const int64_t batch = logits.size(0);
  const auto on_device = [&](const torch::Tensor& t, at::ScalarType dtype) {
    return t.device() == logits.device() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == batch &&
           t.is_contiguous();
  };
  TORCH_CHECK(on_device(temperature, at::kFloat), "temperature must be a contiguous (batch,) float32 tensor");
  TORCH_CHECK(on_device(seeds, at::kLong), "seeds must be a contiguous (batch,) int64 tensor");
  llgtrt::LogitsType type;
  switch (logits.scalar_type()) {
    case at::kFloat: type = llgtrt::LogitsType::kFloat32; break;
    case at::kHalf: type = llgtrt::LogitsType::kFloat16; break;
    case at::kBFloat16: type = llgtrt::LogitsType::kBFloat16; break;
    default: TORCH_CHECK(false, "logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  }

  llgtrt::SamplingArgs args{};
  args.logits = logits.data_ptr();
  args.batch = batch;
  args.row_stride = logits.stride(0);
  args.vocab = static_cast<int>(logits.size(1));
  if (bitmask.has_value()) {
    TORCH_CHECK(bitmask->device() == logits.device() && bitmask->dim() == 2 && bitmask->scalar_type() == at::kInt &&
                    bitmask->stride(1) == 1,
                "bitmask must be a 2-D int32 tensor with contiguous rows on the logits' device");
    args.bitmask = bitmask->data_ptr<int32_t>();
    args.mask_row_stride = bitmask->stride(0);
    args.mask_words = static_cast<int>(bitmask->size(1));
    args.mask_rows = batch;
    if (rows.has_value()) {
      args.rows = check_rows(*rows, logits);
      args.mask_rows = rows->numel();
    }
    TORCH_CHECK(bitmask->size(0) == args.mask_rows, "bitmask has ", bitmask->size(0), " rows, expected ",
                args.mask_rows);
  }
  args.temperature = temperature.data_ptr<float>();
  args.seeds = seeds.data_ptr<int64_t>();

  const c10::cuda::CUDAGuard device_guard(logits.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, logits.get_device()));
  const int splits = llgtrt::sampling_splits(batch, args.vocab, sms);
  auto partial_score = torch::empty({batch, splits}, logits.options().dtype(at::kFloat));
  auto partial_token = torch::empty({batch, splits}, logits.options().dtype(at::kInt));
  auto tokens = torch::empty({batch}, logits.options().dtype(at::kLong));
  args.partial_score = partial_score.data_ptr<float>();
  args.partial_token = partial_token.data_ptr<int32_t>();
  args.tokens = tokens.data_ptr<int64_t>();
  C10_CUDA_CHECK(llgtrt::sample_with_bitmask(args, type, splits, c10::cuda::getCurrentCUDAStream()));
  return tokens;
}

void narrow_to_endings(torch::Tensor masks, torch::Tensor positions, torch::Tensor tables, int64_t string_classes) {
  TORCH_CHECK(masks.is_cuda() && masks.dim() == 2 && masks.scalar_type() == at::kInt && masks.stride(1) == 1,
              "masks must be a 2-D int32 CUDA tensor with contiguous rows");
  TORCH_CHECK(positions.device() == masks.device() && positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous 1-D int64 tensor on the masks' device");
  TORCH_CHECK(tables.device() == masks.device() && tables.dim() == 2 && tables.scalar_type() == at::kInt &&
                  tables.is_contiguous() && tables.size(1) == masks.size(1) && tables.size(0) >= 2 &&
                  tables.size(0) <= 10,
              "tables must be a contiguous (2 + classes, mask words) int32 tensor on the masks' device, "
              "at most 8 classes");
  llgtrt::NarrowArgs args{};
  args.masks = masks.data_ptr<int32_t>();
  args.mask_rows = masks.size(0);
  args.mask_row_stride = masks.stride(0);
  args.mask_words = static_cast<int>(masks.size(1));
  args.positions = positions.data_ptr<int64_t>();
  args.count = positions.numel();
  args.tables = tables.data_ptr<int32_t>();
  args.classes = static_cast<int>(tables.size(0) - 2);
  args.string_classes = static_cast<uint32_t>(string_classes);
  const c10::cuda::CUDAGuard device_guard(masks.device());
  C10_CUDA_CHECK(llgtrt::narrow_to_endings(args, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_inplace", &apply_token_bitmask_inplace,
        "Set logits of disallowed tokens to -inf in place (bitmask: int32, 1 bit per token, 1 = allowed)",
        py::arg("logits"), py::arg("bitmask"), py::arg("rows") = py::none(), py::arg("whole_sectors") = true);
  m.def("sample_with_bitmask", &sample_with_bitmask,
        "Per row: argmax over allowed tokens of logit / T + Gumbel(seed, token) noise (T = 0: argmax)",
        py::arg("logits"), py::arg("temperature"), py::arg("seeds"), py::arg("bitmask") = py::none(),
        py::arg("rows") = py::none());
  m.def("narrow_to_endings", &narrow_to_endings,
        "Narrow mask rows near their length limit to the first escape class each allows (the loop guard's)",
        py::arg("masks"), py::arg("positions"), py::arg("tables"), py::arg("string_classes"));
}
