// Weight-only int4 and int8 matmuls for a few rows on AVX-512 VNNI, the way llama.cpp computes
// Q4_1 x Q8_1: each row of activations is quantized to int8 per block of 32 inputs, and the products
// are summed in int32 by vpdpbusd, 64 multiply-adds an instruction, before one float scale per block.
//
// Weights (packed by llgtrt_core/kernels/cpu_quant.py): groups of 16 output rows; per group and
// block of 32 inputs, 8 vectors of 16 lanes x 4 inputs. Lane i holds row i, so one dpbusd against 4
// broadcast activations adds 4 products to each of 16 rows, and a block's float work is one fma
// over 16 rows.
// int4: two vectors to a 64-byte load (low and high nibbles), 256 bytes a group and block.
// Per group and block, 16 scales and 16 minimums as float16 (their bits as int16): weight = scale * q + minimum, q 0..15.
// int8: 512 bytes a group and block, each weight plus 128 (vpdpbusd multiplies unsigned by signed
// bytes: the 128 * sum of the activations is taken off once a row); a bfloat16 scale per output row.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // inputs per scale
constexpr int64_t kRows = 16;   // output rows per group: one zmm lane each
constexpr int64_t kInt4GroupBlockBytes = kRows * kBlock / 2;
constexpr int64_t kInt8GroupBlockBytes = kRows * kBlock;
constexpr int64_t kPrefetchBytes = 2048;  // the weights stream from memory: without asking ahead a row of 1 took 2x as long

// One row of activations as int8 blocks: x = dx[b] * xq[b*32 + k]; sx[b] = dx[b] * sum(xq of block b).
struct QuantizedRow {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  float sum = 0;  // of sx
};

inline __m512 bf16_to_float(const at::BFloat16* p) {  // 16 of them: the high half of each float's bits
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

void quantize_row(const at::BFloat16* x, int64_t k, QuantizedRow& out) {
  const int64_t blocks = k / kBlock;
  out.xq.resize(k);
  out.dx.resize(blocks);
  out.sx.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v[2] = {bf16_to_float(x + b * kBlock), bf16_to_float(x + b * kBlock + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    int32_t sum = 0;
    for (int h = 0; h < 2; ++h) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], inverse));  // round to nearest even
      sum += _mm512_reduce_add_epi32(q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.xq.data() + b * kBlock + h * 16), _mm512_cvtsepi32_epi8(q));
    }
    out.dx[b] = scale;
    out.sx[b] = scale * static_cast<float>(sum);
    out.sum += out.sx[b];
  }
}

std::vector<QuantizedRow> quantize_rows(const at::Tensor& x) {
  std::vector<QuantizedRow> rows(x.size(0));
  for (int64_t r = 0; r < x.size(0); ++r) quantize_row(x.data_ptr<at::BFloat16>() + r * x.size(1), x.size(1), rows[r]);
  return rows;
}

void prefetch(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(static_cast<const char*>(p) + line, _MM_HINT_T0);
}

// A group and block: the 16 rows' int32 dot products with the activation row's block.
inline __m512i block_dot(const __m512i (&wv)[8], const QuantizedRow& row, int64_t b) {
  const int32_t* x4 = reinterpret_cast<const int32_t*>(row.xq.data() + b * kBlock);
  __m512i dot = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, wv[j], _mm512_set1_epi32(x4[j]));
  return dot;
}

// Rows [group_begin, group_end) x 16 of y = x @ W^T, W int4.
void int4_groups(const std::vector<QuantizedRow>& rows, const uint8_t* packed, const at::Half* scales,
                 const at::Half* mins, int64_t blocks, int64_t group_begin, int64_t group_end, float* y, int64_t n) {
  const int64_t m = static_cast<int64_t>(rows.size());
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  std::vector<__m512> acc(m);
  for (int64_t g = group_begin; g < group_end; ++g) {
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t gb = g * blocks + b;
      const uint8_t* w = packed + gb * kInt4GroupBlockBytes;
      prefetch(w + kPrefetchBytes, kInt4GroupBlockBytes);
      prefetch(scales + (gb + kPrefetchBytes / kInt4GroupBlockBytes) * kRows, 1);
      prefetch(mins + (gb + kPrefetchBytes / kInt4GroupBlockBytes) * kRows, 1);
      __m512i wv[8];
      for (int c = 0; c < 4; ++c) {
        __m512i bytes = _mm512_loadu_si512(w + c * 64);
        wv[2 * c] = _mm512_and_si512(bytes, low_nibbles);
        wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + gb * kRows)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + gb * kRows)));
      for (int64_t r = 0; r < m; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(block_dot(wv, rows[r], b));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(rows[r].dx[b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(rows[r].sx[b]), acc[r]);
      }
    }
    for (int64_t r = 0; r < m; ++r) _mm512_storeu_ps(y + r * n + g * kRows, acc[r]);
  }
}

// Rows [group_begin, group_end) x 16 of y = x @ W^T, W int8 (stored plus 128) times a scale per row.
void int8_groups(const std::vector<QuantizedRow>& rows, const uint8_t* packed, const at::BFloat16* scales, int64_t blocks,
                 int64_t group_begin, int64_t group_end, float* y, int64_t n) {
  const int64_t m = static_cast<int64_t>(rows.size());
  std::vector<__m512> acc(m);
  for (int64_t g = group_begin; g < group_end; ++g) {
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* w = packed + (g * blocks + b) * kInt8GroupBlockBytes;
      prefetch(w + kPrefetchBytes, kInt8GroupBlockBytes);
      __m512i wv[8];
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(w + j * 64);
      for (int64_t r = 0; r < m; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(wv, rows[r], b)), _mm512_set1_ps(rows[r].dx[b]), acc[r]);
    }
    const __m512 scale = bf16_to_float(scales + g * kRows);
    for (int64_t r = 0; r < m; ++r)
      _mm512_storeu_ps(y + r * n + g * kRows,
                       _mm512_mul_ps(_mm512_sub_ps(acc[r], _mm512_set1_ps(128.0f * rows[r].sum)), scale));
  }
}

// Helper threads for the matmuls while the cores are otherwise idle (the engine says so a step at
// a time: `set_threads`). A matmul's 16-row groups are cut into chunks that every thread claims
// as it gets to them, the caller included: a helper the OS has not run yet costs nothing (the
// caller takes its chunks), one it stops costs the chunk it holds. An OpenMP team's static
// shares and barriers made two threads slower than one on a busy machine (docs/benchmarks/cpu.md).
class WorkSharing {
 public:
  static WorkSharing& get() {
    static WorkSharing* instance = new WorkSharing();  // never destroyed: helpers may outlive static destruction
    return *instance;
  }

  void set_threads(int64_t threads) {
    threads_ = std::max<int64_t>(1, threads);
    std::lock_guard<std::mutex> lock(spawn_);
    while (static_cast<int64_t>(helpers_.size()) < threads_ - 1) helpers_.emplace_back([this] { help(); }).detach();
  }

  // f(chunk) for every chunk in [0, chunks), on the caller and whichever helpers join in. One caller
  // at a time shares: a second thread's matmul meanwhile (the compile thread warming up its graphs
  // while the engine thread serves) runs on that thread alone. Two callers on the one job_ and
  // state_ had the helpers run one caller's chunks with the other's function: the engine process
  // died of SIGSEGV (session 15).
  void run(int64_t chunks, const std::function<void(int64_t)>& f) {
    std::unique_lock<std::mutex> sharing(run_, std::try_to_lock);
    if (!sharing.owns_lock() || threads_ == 1 || chunks < 2) {
      for (int64_t c = 0; c < chunks; ++c) f(c);
      return;
    }
    job_ = &f;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(epoch << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(wake_);
      woken_.notify_all();
    }
    work(epoch);
    while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();
  }

 private:
  static constexpr int64_t kSpinRounds = 20000;  // ~100 us of pauses: a step's next matmul comes sooner

  // Claims and runs chunks of `epoch` while any is left. state_: epoch (32 bits) | chunks (16) | next (16).
  void work(uint64_t epoch) {
    uint64_t state = state_.load(std::memory_order_acquire);
    while ((state >> 32) == epoch && (state & 0xFFFF) < ((state >> 16) & 0xFFFF)) {
      if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) continue;
      (*job_)(static_cast<int64_t>(state & 0xFFFF));
      done_.fetch_add(1, std::memory_order_release);
      state = state_.load(std::memory_order_acquire);
    }
  }

  void help() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t epoch = state_.load(std::memory_order_acquire) >> 32;
      for (int64_t spin = 0; epoch == seen && spin < kSpinRounds; ++spin) {
        _mm_pause();
        epoch = state_.load(std::memory_order_acquire) >> 32;
      }
      if (epoch == seen) {
        std::unique_lock<std::mutex> lock(wake_);
        sleeping_.store(true, std::memory_order_seq_cst);
        woken_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
        sleeping_.store(false, std::memory_order_relaxed);
        epoch = state_.load(std::memory_order_acquire) >> 32;
      }
      seen = epoch;
      work(epoch);
    }
  }

  std::atomic<int64_t> threads_{1};
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* job_ = nullptr;
  std::atomic<bool> sleeping_{false};
  std::mutex wake_, spawn_, run_;
  std::condition_variable woken_;
  std::vector<std::thread> helpers_;
};

// Groups per chunk: ~32 KB of weights, so that claiming one costs little next to reading it.
int64_t chunk_groups(int64_t groups, int64_t group_bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(groups, 32768 / group_bytes));
}

void share_groups(int64_t groups, int64_t group_bytes, const std::function<void(int64_t, int64_t)>& f) {
  const int64_t per_chunk = std::max(chunk_groups(groups, group_bytes), (groups + 0xFFFE) / 0xFFFF);
  WorkSharing::get().run((groups + per_chunk - 1) / per_chunk, [&](int64_t chunk) {
    f(chunk * per_chunk, std::min(groups, (chunk + 1) * per_chunk));
  });
}

at::Tensor checked_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % kBlock == 0,
              "x: (rows, in) bfloat16, in a multiple of ", kBlock);
  return x.contiguous();
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
  const at::Tensor x = checked_x(x_in);
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock, n = scales.numel() / blocks;
  TORCH_CHECK(n % kRows == 0 && packed.numel() == n * k / 2 && mins.numel() == scales.numel(),
              "packed int4 weights do not match x");
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const std::vector<QuantizedRow> rows = quantize_rows(x);
  share_groups(n / kRows, blocks * kInt4GroupBlockBytes, [&](int64_t begin, int64_t end) {
    int4_groups(rows, packed.data_ptr<uint8_t>(), reinterpret_cast<const at::Half*>(scales.data_ptr<int16_t>()),
                reinterpret_cast<const at::Half*>(mins.data_ptr<int16_t>()), blocks, begin, end, y.data_ptr<float>(), n);
  });
  return y.to(at::kBFloat16);
}

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales) {
  const at::Tensor x = checked_x(x_in);
  const int64_t m = x.size(0), k = x.size(1), n = scales.numel();
  TORCH_CHECK(n % kRows == 0 && packed.numel() == n * k && scales.scalar_type() == at::kBFloat16,
              "packed int8 weights do not match x");
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const std::vector<QuantizedRow> rows = quantize_rows(x);
  share_groups(n / kRows, k / kBlock * kInt8GroupBlockBytes, [&](int64_t begin, int64_t end) {
    int8_groups(rows, packed.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(), k / kBlock, begin, end,
                y.data_ptr<float>(), n);
  });
  return y.to(at::kBFloat16);
}

void set_threads(int64_t threads) { WorkSharing::get().set_threads(threads); }

}  // namespace

TORCH_LIBRARY(llgtrt_cpu, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("set_threads(int threads) -> ()", &set_threads);
}

TORCH_LIBRARY_IMPL(llgtrt_cpu, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
}
