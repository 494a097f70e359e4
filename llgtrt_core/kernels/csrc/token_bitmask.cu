// Apply a packed token bitmask (llguidance / XGrammar / TensorRT-LLM layout) to logits in place.
//
// Bit t%32 of word t//32 set = token t allowed. Every disallowed logit becomes -inf, and so does
// every logit at or past 32 * mask width (logits wider than the tokenizer's vocab). The kernel
// reads the bitmask, writes disallowed positions, and reads logits only inside 32-byte sectors
// that mix allowed and disallowed tokens (see kWholeSectors), so its cost stays at the mask read
// plus the masked writes, the memory-bound floor of this operation.
//
// The fill value is a raw bit pattern, so one kernel per element width serves f32 (4 bytes)
// and f16 / bf16 (2 bytes). This file holds no torch code: token_bitmask.cpp binds it.

#include "token_bitmask.h"

#include <algorithm>

namespace llgtrt {
namespace {

constexpr int kThreads = 256;

// One chunk = kVec consecutive tokens of a row: 16 bytes when vectorized (4 x f32 or
// 8 x f16/bf16), one token otherwise (unaligned or column-strided logits). Two chunks make a
// 32-byte sector, the unit in which L2 writes to HBM (rows are assumed 32-byte aligned for
// speed, not for correctness).
template <typename Bits, bool kVectorized>
struct Chunk {
  static constexpr int kVec = kVectorized ? 16 / static_cast<int>(sizeof(Bits)) : 1;
  static constexpr uint32_t kAll = (1u << kVec) - 1;
  static constexpr int kSector = 2 * kVec;
  static constexpr uint32_t kSectorAll = (1u << kSector) - 1;
};

// Bits `first` .. `first + n` of `word` (n <= 16), with tokens at or past `vocab` set: they
// count as allowed, so nothing is ever written past the end of a row.
__device__ __forceinline__ uint32_t allowed_bits(uint32_t word, int first, int n, uint32_t all, int vocab) {
  uint32_t bits = (word >> (first & 31)) & all;
  if (first + n > vocab) bits |= all & (~0u << max(vocab - first, 0));
  return bits;
}

// 32-bit lane mask of the disallowed elements among the elements packed in 32-bit word `w`
// of a 16-byte chunk whose per-element allowed bits are `bits`.
template <typename Bits>
__device__ __forceinline__ uint32_t disallowed_lanes(uint32_t bits, int w) {
  if constexpr (sizeof(Bits) == 4) {
    return ((bits >> w) & 1u) ? 0u : ~0u;
  } else {
    return (((bits >> (2 * w)) & 1u) ? 0u : 0x0000FFFFu) | (((bits >> (2 * w + 1)) & 1u) ? 0u : 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint32_t select_bits(uint32_t keep, uint32_t replace, uint32_t replace_mask) {
  return (keep & ~replace_mask) | (replace & replace_mask);
}

// Grid: x = tiles of kThreads * kItems chunks along the row, y = mask rows (strided loop).
//
// kWholeSectors: a 32-byte sector holding both allowed and disallowed tokens is read and
// written back whole instead of written element by element. HBM takes whole sectors: a
// partially written one costs the memory system a read-modify-write of its own, measured
// 1.5-2x slower overall (bench/mask_kernel.py, "masked writes only"). Sectors that are all
// allowed are never touched and all-disallowed ones are only written, so at JSON-like masks
// (~99% disallowed) nearly every access is a 16-byte store.
template <typename Bits, bool kVectorized, int kItems, bool kWholeSectors>
__global__ void __launch_bounds__(kThreads, 8) apply_token_bitmask_kernel(BitmaskArgs args, Bits fill) {
  using C = Chunk<Bits, kVectorized>;
  const int vocab = args.vocab;
  const int n_chunks = (vocab + C::kVec - 1) / C::kVec;
  const int tile_start = blockIdx.x * kThreads * kItems + threadIdx.x;
  const uint32_t fill_word = sizeof(Bits) == 4 ? fill : (uint32_t(fill) << 16 | fill);

  for (int64_t j = blockIdx.y; j < args.mask_rows; j += gridDim.y) {
    const int64_t r = args.rows ? args.rows[j] : j;
    if (r < 0 || r >= args.batch) continue;  // a bad row index must not become a stray write
    Bits* row = static_cast<Bits*>(args.logits) + r * args.row_stride;
    const int32_t* mask_row = args.bitmask + j * args.mask_row_stride;

    // Issue every mask load of this thread before the first store: they are the only latency
    // on the common path. (Hoisting the logits loads of rewritten chunks too needs 40+
    // registers, hence lower occupancy, and was measured 15% slower.)
    uint32_t chunk_bits[kItems];
    bool sector_untouched[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = tile_start + i * kThreads;
      const int t0 = c * C::kVec;
      const int w = t0 >> 5;
      const uint32_t word = (c < n_chunks && w < args.mask_words) ? __ldg(mask_row + w) : 0u;
      chunk_bits[i] = c < n_chunks ? allowed_bits(word, t0, C::kVec, C::kAll, vocab) : C::kAll;
      const int s0 = t0 & ~(C::kSector - 1);
      sector_untouched[i] = !kWholeSectors || c >= n_chunks ||
                            allowed_bits(word, s0, C::kSector, C::kSectorAll, vocab) == C::kSectorAll;
    }

#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const uint32_t bits = chunk_bits[i];
      const int t0 = (tile_start + i * kThreads) * C::kVec;
      if constexpr (kVectorized) {
        if (bits == 0) {  // the common case under a grammar: a whole 16-byte store
          *reinterpret_cast<uint4*>(row + t0) = make_uint4(fill_word, fill_word, fill_word, fill_word);
          continue;
        }
        if (kWholeSectors && !sector_untouched[i] && t0 + C::kVec <= vocab) {
          uint4 v = *reinterpret_cast<const uint4*>(row + t0);
          v.x = select_bits(v.x, fill_word, disallowed_lanes<Bits>(bits, 0));
          v.y = select_bits(v.y, fill_word, disallowed_lanes<Bits>(bits, 1));
          v.z = select_bits(v.z, fill_word, disallowed_lanes<Bits>(bits, 2));
          v.w = select_bits(v.w, fill_word, disallowed_lanes<Bits>(bits, 3));
          *reinterpret_cast<uint4*>(row + t0) = v;
          continue;
        }
      }
      if (bits == C::kAll) continue;
#pragma unroll
      for (int k = 0; k < C::kVec; ++k) {
        if (!((bits >> k) & 1u)) row[kVectorized ? t0 + k : static_cast<int64_t>(t0 + k) * args.col_stride] = fill;
      }
    }
  }
}

template <typename Bits>
cudaError_t launch(const BitmaskArgs& args, Bits fill, bool whole_sectors, int sms, cudaStream_t stream) {
  const int64_t elem = static_cast<int64_t>(sizeof(Bits));
  const bool vectorized = args.col_stride == 1 && reinterpret_cast<uintptr_t>(args.logits) % 16 == 0 &&
                          (args.row_stride * elem) % 16 == 0;
  const int vec = vectorized ? 16 / static_cast<int>(elem) : 1;
  const int64_t n_chunks = (args.vocab + vec - 1) / vec;
  // Chunks per thread: as many independent mask loads in flight as still fill one wave of
  // resident blocks (8 per SM), else one, so a small job spreads over every SM. 16-bit types
  // stop at two (their 32-byte sectors hold 16 tokens: more items per thread was 2-4% slower
  // at batch 64-256 on an H200, bench/mask_kernel_variants.cu).
  const int64_t chunks = args.mask_rows * n_chunks;
  const int64_t one_wave = int64_t(kThreads) * 8 * sms;
  const int large_items = elem == 2 ? 2 : 4;
  const int items = chunks >= large_items * one_wave ? large_items : 1;
  const dim3 grid(static_cast<unsigned>((n_chunks + kThreads * items - 1) / (kThreads * items)),
                  static_cast<unsigned>(std::min<int64_t>(args.mask_rows, 65535)));
#define LLGTRT_LAUNCH(VEC, WHOLE)                                                                           \
  if (items == 1) apply_token_bitmask_kernel<Bits, VEC, 1, WHOLE><<<grid, kThreads, 0, stream>>>(args, fill);      \
  else if (items == 2) apply_token_bitmask_kernel<Bits, VEC, 2, WHOLE><<<grid, kThreads, 0, stream>>>(args, fill); \
  else apply_token_bitmask_kernel<Bits, VEC, 4, WHOLE><<<grid, kThreads, 0, stream>>>(args, fill)
  if (!vectorized) { LLGTRT_LAUNCH(false, false); }
  else if (whole_sectors) { LLGTRT_LAUNCH(true, true); }
  else { LLGTRT_LAUNCH(true, false); }
#undef LLGTRT_LAUNCH
  return cudaGetLastError();
}

constexpr int kNarrowThreads = 256;
constexpr int kMaxClasses = 8;

// Block i narrows row positions[i]: every thread tests its words against the tables, the block
// agrees on the flags (__syncthreads_or), then each thread writes back the words it read.
__global__ void __launch_bounds__(kNarrowThreads) narrow_to_endings_kernel(NarrowArgs args) {
  const int64_t r = args.positions[blockIdx.x];
  if (r < 0 || r >= args.mask_rows) return;  // the same for the whole block
  int32_t* row = args.masks + r * args.mask_row_stride;
  const int words = args.mask_words;
  int in_string = 0, free_text = 0, allows[kMaxClasses] = {};
  for (int w = threadIdx.x; w < words; w += kNarrowThreads) {
    const int32_t m = row[w];
    in_string |= (m & __ldg(args.tables + w)) != 0;
    free_text |= (m & __ldg(args.tables + words + w)) != 0;
    for (int c = 0; c < args.classes; ++c) allows[c] |= (m & __ldg(args.tables + (2 + c) * words + w)) != 0;
  }
  in_string = __syncthreads_or(in_string);
  free_text = __syncthreads_or(free_text);
  int chosen = -1;
  for (int c = 0; c < args.classes; ++c) {
    const int allowed = __syncthreads_or(allows[c]);
    if (chosen < 0 && allowed && (!in_string || ((args.string_classes >> c) & 1u))) chosen = c;
  }
  if (chosen < 0 || (in_string && free_text)) return;
  const int32_t* bits = args.tables + (2 + chosen) * words;
  for (int w = threadIdx.x; w < words; w += kNarrowThreads) row[w] &= __ldg(bits + w);
}

}  // namespace

cudaError_t narrow_to_endings(const NarrowArgs& args, cudaStream_t stream) {
  if (args.count == 0 || args.mask_words == 0) return cudaSuccess;
  if (args.classes > kMaxClasses || args.count > 2147483647) return cudaErrorInvalidValue;
  narrow_to_endings_kernel<<<static_cast<unsigned>(args.count), kNarrowThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t apply_token_bitmask(const BitmaskArgs& args, int element_bytes, uint32_t fill_bits, bool whole_sectors,
                                int sms, cudaStream_t stream) {
  if (args.mask_rows == 0 || args.vocab == 0) return cudaSuccess;
  if (element_bytes == 4) return launch<uint32_t>(args, fill_bits, whole_sectors, sms, stream);
  return launch<uint16_t>(args, static_cast<uint16_t>(fill_bits), whole_sectors, sms, stream);
}

}  // namespace llgtrt
