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

// The loop guard's narrowing of rows near their length limit (constraints/loop_guard.py,
// `EscapeMasks.narrow` for a row that loops over no items), one block per row: mask row
// positions[i] is ANDed with the first escape class it allows a token of, in class order, or left
// as it is when it allows none. tables: (2 + classes, mask_words) int32 rows: the word tokens
// (only a JSON string allows them), the tokens holding a raw newline (free text: never narrowed),
// then each class. A row allowing a word is inside a string, where only the classes set in
// `string_classes` (a bit per class) end it.
struct NarrowArgs {
  int32_t* masks;           // (mask_rows, mask_words), rows contiguous
  int64_t mask_rows;
  int64_t mask_row_stride;  // in words
  int mask_words;
  const int64_t* positions;  // rows to narrow; outside [0, mask_rows): skipped
  int64_t count;
  const int32_t* tables;     // (2 + classes, mask_words), contiguous
  int classes;               // at most 8
  uint32_t string_classes;
};

cudaError_t narrow_to_endings(const NarrowArgs& args, cudaStream_t stream);

}  // namespace llgtrt
