// Launcher of the bitmask kernel, free of torch so the .cu file compiles quickly.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace llgtrt {

struct BitmaskArgs {
  void* logits;             // (batch, vocab) elements of 2 or 4 bytes
  int64_t batch;            // logits rows: row indices outside [0, batch) are skipped
  int64_t row_stride;       // in elements
  int64_t col_stride;       // in elements; 1 enables 16-byte stores
  int vocab;                // logits columns
  const int32_t* bitmask;   // (mask_rows, mask_words), rows contiguous
  int64_t mask_rows;
  int64_t mask_row_stride;  // in words
  int mask_words;           // tokens >= 32 * mask_words are disallowed
  const int64_t* rows;      // mask row j -> logits row rows[j]; nullptr: row j
};

// Sets every disallowed logit to the element pattern `fill_bits` (element_bytes 2 or 4).
// whole_sectors: rewrite 32-byte sectors that mix allowed and disallowed tokens whole (faster on
// HBM than partial writes); false: write only the disallowed elements.
cudaError_t apply_token_bitmask(const BitmaskArgs& args, int element_bytes, uint32_t fill_bits, bool whole_sectors,
                                int sms, cudaStream_t stream);

}  // namespace llgtrt
