// Launcher of the fused mask + temperature + sample/argmax kernel, free of torch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace llgtrt {

struct SamplingArgs {
  const void* logits;          // (batch, vocab) f32 / f16 / bf16, unit column stride
  int64_t batch;
  int64_t row_stride;          // in elements
  int vocab;
  const int32_t* bitmask;      // (mask rows, mask_words); nullptr: no row is constrained
  int64_t mask_row_stride;     // in words
  int mask_words;              // tokens >= 32 * mask_words are disallowed in constrained rows
  const int64_t* rows;         // mask row j -> logits row rows[j]; nullptr: row j (then every row
  int64_t mask_rows;           // is constrained); logits rows not listed sample from every token
  const float* temperature;    // (batch,), 0 = greedy
  const int64_t* seeds;        // (batch,) key of each row's noise
  float* partial_score;        // (batch, splits) workspace
  int32_t* partial_token;      // (batch, splits) workspace
  int64_t* tokens;             // (batch,) output
};

enum class LogitsType { kFloat32, kFloat16, kBFloat16 };

// Number of blocks each row is split over (the workspace's second dimension).
int sampling_splits(int64_t batch, int vocab, int sms);

cudaError_t sample_with_bitmask(const SamplingArgs& args, LogitsType type, int splits, cudaStream_t stream);

}  // namespace llgtrt
