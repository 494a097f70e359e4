// Constrained sampling in one pass over the logits: token = argmax over allowed tokens of
// logit / T + Gumbel noise (T > 0: an exact sample of softmax(logit / T); T = 0: argmax).
// Disallowed tokens score -inf, as if the bitmask had been applied first; the logits are
// only read. The noise is a counter-based hash of (row seed, token), so a row's sample depends
// on its seed alone, not on the batch around it; sampling.py computes the same hash in torch.
//
// Pass 1: (batch x splits) blocks each reduce a slice of a row to (best score, token).
// Pass 2: one warp per row reduces the splits. Ties go to the lowest token, like torch.argmax.

#include "masked_sampling.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <climits>

namespace llgtrt {
namespace {

constexpr int kThreads = 512;
constexpr int kMinTokensPerBlock = kThreads * 2;
// Above every value gumbel() returns (-log(-log(1 - 2^-24)) = 16.6355).
constexpr float kMaxGumbel = 16.75f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Chris Wellons' lowbias32: a cheap hash with full avalanche.
__device__ __forceinline__ uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ uint32_t row_key(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return lowbias32(static_cast<uint32_t>(s) ^ lowbias32(static_cast<uint32_t>(s >> 32)));
}

// Gumbel(0, 1) noise of token t: -log(-log(u)), u uniform from 23 hash bits, in
// [2^-24, 1 - 2^-24] so that the noise is always finite (24 bits would round u up to 1).
__device__ __forceinline__ float gumbel(uint32_t key, uint32_t token) {
  const uint32_t h = lowbias32(lowbias32(token ^ key) + key);
  const float u = (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

struct Best {
  float score;
  int32_t token;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.score > a.score || (b.score == a.score && b.token < a.token)) ? b : a;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, b.score, offset), __shfl_xor_sync(0xffffffffu, b.token, offset)};
    b = better(b, other);
  }
  return b;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) partial_best_kernel(SamplingArgs args, int splits) {
  const int64_t row = blockIdx.y;
  const int split = blockIdx.x;
  const int per_split = (args.vocab + splits - 1) / splits;
  const int begin = split * per_split;
  const int end = min(args.vocab, begin + per_split);
  const T* logits = static_cast<const T*>(args.logits) + row * args.row_stride;
  // This row's mask row: a block-wide search of `rows` (a few hundred entries at most) costs
  // less than a separate launch that inverts it.
  __shared__ int64_t found_mask_row;
  if (threadIdx.x == 0) found_mask_row = args.bitmask && !args.rows && row < args.mask_rows ? row : -1;
  __syncthreads();
  if (args.bitmask && args.rows) {
    for (int64_t j = threadIdx.x; j < args.mask_rows; j += kThreads) {
      if (args.rows[j] == row) found_mask_row = j;
    }
    __syncthreads();
  }
  const int32_t* mask = found_mask_row >= 0 ? args.bitmask + found_mask_row * args.mask_row_stride : nullptr;
  const float temperature = args.temperature[row];
  const bool greedy = temperature == 0.0f;
  const uint32_t key = row_key(args.seeds[row]);

  Best best{-INFINITY, INT_MAX};
  for (int t = begin + threadIdx.x; t < end; t += kThreads) {
    const float logit = to_float(logits[t]);
    bool allowed = true;
    if (mask) {
      const int w = t >> 5;
      allowed = w < args.mask_words && ((__ldg(mask + w) >> (t & 31)) & 1);
    }
    if (!allowed) continue;  // scores -inf: loses to every allowed token, ties to none before it
    float score = logit;
    if (!greedy) {
      score = logit / temperature;
      if (score + kMaxGumbel < best.score) continue;  // cannot win whatever its noise: skip the hash
      score += gumbel(key, static_cast<uint32_t>(t));
    }
    best = better(best, Best{score, t});
  }

  __shared__ float scores[kThreads / 32];
  __shared__ int32_t tokens[kThreads / 32];
  best = warp_best(best);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scores[warp] = best.score;
    tokens[warp] = best.token;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kThreads / 32 ? Best{scores[lane], tokens[lane]} : Best{-INFINITY, INT_MAX};
    best = warp_best(best);
    if (lane == 0) {
      args.partial_score[row * splits + split] = best.score;
      args.partial_token[row * splits + split] = best.token;
    }
  }
}

__global__ void final_best_kernel(SamplingArgs args, int splits) {
  const int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= args.batch) return;
  const int lane = threadIdx.x % 32;
  Best best{-INFINITY, INT_MAX};
  for (int s = lane; s < splits; s += 32) {
    best = better(best, Best{args.partial_score[row * splits + s], args.partial_token[row * splits + s]});
  }
  best = warp_best(best);
  // Every score -inf (all tokens disallowed): token 0, as argmax over an all -inf row gives.
  if (lane == 0) args.tokens[row] = best.token == INT_MAX ? 0 : best.token;
}

}  // namespace

int sampling_splits(int64_t batch, int vocab, int sms) {
  const int64_t wanted = (2 * static_cast<int64_t>(sms) + batch - 1) / batch;
  const int64_t most = (vocab + kMinTokensPerBlock - 1) / kMinTokensPerBlock;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, most)));
}

cudaError_t sample_with_bitmask(const SamplingArgs& args, LogitsType type, int splits, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  const dim3 grid(splits, static_cast<unsigned>(args.batch));
  switch (type) {
    case LogitsType::kFloat32: partial_best_kernel<float><<<grid, kThreads, 0, stream>>>(args, splits); break;
    case LogitsType::kFloat16: partial_best_kernel<__half><<<grid, kThreads, 0, stream>>>(args, splits); break;
    case LogitsType::kBFloat16: partial_best_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(args, splits); break;
  }
  const int rows_per_block = 8;
  final_best_kernel<<<static_cast<unsigned>((args.batch + rows_per_block - 1) / rows_per_block), 32 * rows_per_block, 0,
                      stream>>>(args, splits);
  return cudaGetLastError();
}

}  // namespace llgtrt
