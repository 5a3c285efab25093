// y[M, N] (float32) = x[M, K] (bf16) . w[K, N] (bf16, row-major): a product of a few rows with a
// weight, the decode step's projections, as an XLA FFI custom call for the CPU (AVX-512).
//
// A decode step at a small batch reads every weight once and does ~M multiply-adds per weight:
// its speed is the rate at which the weight streams from memory. The weight is read as stored,
// row after row (a row's columns are contiguous: the hardware prefetchers follow), each bf16
// widened to float32 by a 16-bit shift (or a mask), and the M products accumulated in float32 in a
// partial y (eight weight rows per pass over it). The rows are cut into blocks of 256 that the calling thread
// and helper tasks on XLA's intra-op pool claim one by one, so no block waits on a busy helper.
//
// Summation: in float32, k ascending within a block, then the blocks' sums in block order: the
// same bits whichever thread ran which block.
//
// The library is compiled without host-specific flags; the functions that use AVX-512 carry target
// attributes and run only after `jaxpi_*_supported()` said the CPU has the instructions, so one
// build in a shared cache serves hosts with and without them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define JAXPI_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define JAXPI_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kBlock = 256;  // weight rows per task (and per partial sum)

// Everything that uses AVX-512 instructions, and only that, is in this namespace.
namespace avx512 {

// 16 bf16 as float32: the bits shifted into the high half. Full vectors use unmasked loads and
// stores: on AMD Zen an AVX-512 masked store runs several times slower than a plain one (it
// halved this kernel's rate when every store was masked), so masks are for the last columns.
JAXPI_AVX512 inline __m512 widen(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

JAXPI_AVX512 inline __m512 widen(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline float widen1(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// acc[m, g:g+32] += sum_j xs[m][j] * w[k + j, g:g+32] for j < R (r = &w[k, 0]), in the split
// layout: a 512-bit load holds 32 bf16 columns; shifting each 32-bit lane left by 16 gives the
// even columns as float32, masking off its low half the odd ones (no widening instruction), and
// acc keeps, per group of 32 columns, the 16 even ones and then the 16 odd ones (`unsplit` puts
// them back in order once, at the end).
template <int R>
JAXPI_AVX512 inline void rows_of_group(const uint16_t* r, int64_t n_dim, int64_t g, const float (*xs)[8],
                                       float* acc, int64_t m_rows) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[R], odd[R];
  for (int j = 0; j < R; ++j) {
    const __m512i v = _mm512_loadu_si512(r + j * n_dim + g);
    even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
  }
  for (int64_t m = 0; m < m_rows; ++m) {
    float* y = acc + m * n_dim + g;
    __m512 se = _mm512_loadu_ps(y), so = _mm512_loadu_ps(y + 16);
    for (int j = 0; j < R; ++j) {
      const __m512 xb = _mm512_set1_ps(xs[m][j]);
      se = _mm512_fmadd_ps(xb, even[j], se);
      so = _mm512_fmadd_ps(xb, odd[j], so);
    }
    _mm512_storeu_ps(y, se);
    _mm512_storeu_ps(y + 16, so);
  }
}

template <int R>
JAXPI_AVX512 void groups_of_rows(const uint16_t* r, int64_t n_dim, int64_t groups, const float (*xs)[8],
                                 float* acc, int64_t m_rows) {
  for (int64_t g = 0; g < groups; g += 32) rows_of_group<R>(r, n_dim, g, xs, acc, m_rows);
}

// acc[M, N] += x[:, k0:k1] . w[k0:k1, :], the weight's rows read in order, eight at a time (the
// fewer loads and stores of acc per weight byte, the nearer the read stream's rate). Columns past
// the last whole group of 32 stay in order, 16 at a time (the last ones masked).
JAXPI_AVX512 void block(const uint16_t* x, const uint16_t* w, float* acc, int64_t m_rows, int64_t k_dim,
                        int64_t n_dim, int64_t k0, int64_t k1) {
  const int64_t groups = n_dim / 32 * 32;
  float xs[kMaxRows][8];
  for (int64_t k = k0; k < k1; k += 8) {
    const int64_t rows = std::min<int64_t>(8, k1 - k);
    for (int64_t m = 0; m < m_rows; ++m)
      for (int j = 0; j < 8; ++j) xs[m][j] = j < rows ? widen1(x[m * k_dim + k + j]) : 0.0f;
    const uint16_t* r = w + k * n_dim;
    switch (rows) {
      case 8: groups_of_rows<8>(r, n_dim, groups, xs, acc, m_rows); break;
      case 7: groups_of_rows<7>(r, n_dim, groups, xs, acc, m_rows); break;
      case 6: groups_of_rows<6>(r, n_dim, groups, xs, acc, m_rows); break;
      case 5: groups_of_rows<5>(r, n_dim, groups, xs, acc, m_rows); break;
      case 4: groups_of_rows<4>(r, n_dim, groups, xs, acc, m_rows); break;
      case 3: groups_of_rows<3>(r, n_dim, groups, xs, acc, m_rows); break;
      case 2: groups_of_rows<2>(r, n_dim, groups, xs, acc, m_rows); break;
      default: groups_of_rows<1>(r, n_dim, groups, xs, acc, m_rows); break;
    }
    for (int64_t j = 0; j < rows; ++j) {  // the last (< 32) columns, one weight row at a time
      for (int64_t n = groups; n < n_dim; n += 16) {
        const int64_t width = std::min<int64_t>(16, n_dim - n);
        const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
        const __m512 a = width == 16 ? widen(r + j * n_dim + n) : widen(r + j * n_dim + n, mask);
        for (int64_t m = 0; m < m_rows; ++m) {
          float* y = acc + m * n_dim + n;
          if (width == 16) {
            _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_set1_ps(xs[m][j]), a, _mm512_loadu_ps(y)));
          } else {
            const __m512 s = _mm512_maskz_loadu_ps(mask, y);
            _mm512_mask_storeu_ps(y, mask, _mm512_fmadd_ps(_mm512_set1_ps(xs[m][j]), a, s));
          }
        }
      }
    }
  }
}

// y[M, N] from the split layout back to column order (the whole groups of 32 columns).
JAXPI_AVX512 void unsplit(float* y, int64_t m_rows, int64_t n_dim) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t g = 0; g + 32 <= n_dim; g += 32) {
      float* p = y + m * n_dim + g;
      const __m512 even = _mm512_loadu_ps(p), odd = _mm512_loadu_ps(p + 16);
      _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, first, odd));
      _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(even, second, odd));
    }
  }
}

// --- packed_bf16: more rows (a decode step at batch 5-64) on AVX-512 BF16 dot products ---------
//
// w is packed per strip of 32 columns ([strips, K/2, 32, 2]: the two weight rows of a pair side by
// side for each column), so a strip is one contiguous stream and each 64-byte load is the operand
// of vdpbf16ps as it stands (16 columns, two bf16 per float32 lane). x's pair x[m, 2p], x[m, 2p+1]
// is broadcast as one 32-bit value; the float32 sums of up to 8 rows × 32 columns stay in registers
// over the whole of K. vdpbf16ps treats inputs and sums below 2^-126 as zero.
//
// Up to 4 rows, S = 2 strips are read side by side (two streams per thread, each column's sum in
// the same order as alone): one stream per thread left the weight streaming at ~50 GB/s where two
// reach ~60 on the 2-core AVX-512 machine (docs/performance.md); 4 streams were slower again.
constexpr int kSideBySideRows = 4;

template <int MR, int S>
JAXPI_AVX512_BF16 void packed_rows(
    const uint16_t* x, int64_t k_dim, const uint16_t* strip, int64_t pairs, float* y, int64_t n_dim) {
  __m512 acc[2 * MR * S];
  for (int i = 0; i < 2 * MR * S; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t whole = k_dim / 2;  // pairs with both x values in x (K odd: the last has one)
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh lo[S], hi[S];
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) {
      lo[s] = (__m512bh)_mm512_loadu_si512(strip + s * pairs * 64 + p * 64);
      hi[s] = (__m512bh)_mm512_loadu_si512(strip + s * pairs * 64 + p * 64 + 32);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      uint32_t pair;
      if (p < whole) {
        std::memcpy(&pair, x + m * k_dim + 2 * p, sizeof pair);
      } else {
        pair = x[m * k_dim + 2 * p];  // the last, odd row of K: its partner is the packing's zero
      }
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        acc[2 * (m * S + s)] = _mm512_dpbf16_ps(acc[2 * (m * S + s)], lo[s], xb);
        acc[2 * (m * S + s) + 1] = _mm512_dpbf16_ps(acc[2 * (m * S + s) + 1], hi[s], xb);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int s = 0; s < S; ++s) {
      _mm512_storeu_ps(y + m * n_dim + 32 * s, acc[2 * (m * S + s)]);
      _mm512_storeu_ps(y + m * n_dim + 32 * s + 16, acc[2 * (m * S + s) + 1]);
    }
  }
}

// All rows of x times strip `c` (y's columns 32c to 32c + 31), eight rows at a time.
JAXPI_AVX512_BF16 void packed_strip(
    const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* wp, int64_t pairs, float* y, int64_t n_dim,
    int64_t c) {
  const uint16_t* strip = wp + c * pairs * 64;
  for (int64_t m0 = 0; m0 < m_dim; m0 += 8) {
    const uint16_t* xs = x + m0 * k_dim;
    float* ys = y + m0 * n_dim + c * 32;
    switch (std::min<int64_t>(8, m_dim - m0)) {
      case 1: packed_rows<1, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 2: packed_rows<2, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 3: packed_rows<3, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 4: packed_rows<4, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 5: packed_rows<5, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 6: packed_rows<6, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      case 7: packed_rows<7, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
      default: packed_rows<8, 1>(xs, k_dim, strip, pairs, ys, n_dim); break;
    }
  }
}

// All (1 to kSideBySideRows) rows of x times strips c and c + 1, side by side.
JAXPI_AVX512_BF16 void packed_strip_pair(
    const uint16_t* x, int64_t m_dim, int64_t k_dim, const uint16_t* wp, int64_t pairs, float* y, int64_t n_dim,
    int64_t c) {
  const uint16_t* strip = wp + c * pairs * 64;
  float* ys = y + c * 32;
  switch (m_dim) {
    case 1: packed_rows<1, 2>(x, k_dim, strip, pairs, ys, n_dim); break;
    case 2: packed_rows<2, 2>(x, k_dim, strip, pairs, ys, n_dim); break;
    case 3: packed_rows<3, 2>(x, k_dim, strip, pairs, ys, n_dim); break;
    default: packed_rows<4, 2>(x, k_dim, strip, pairs, ys, n_dim); break;
  }
}

// packed[s, p, 2c + j] = w[2p + j, 32s + c], zeros past K and N: rows 2p and 2p + 1 of a strip
// interleaved by one permutation each for its two halves (16 columns each).
JAXPI_AVX512 void pack_strips(const uint16_t* w, int64_t k_dim, int64_t n_dim, uint16_t* out, int64_t pairs,
                              int64_t s0, int64_t s1) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  // Tiles of 16 pairs of rows by 32 strips: 32 rows read 2 KB each and 32 strips written 2 KB
  // each per tile, so neither side jumps to a new page every 64 bytes.
  for (int64_t t0 = s0; t0 < s1; t0 += 32)
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    const int64_t p1 = std::min<int64_t>(pairs, p0 + 16);
    for (int64_t s = t0; s < std::min<int64_t>(s1, t0 + 32); ++s) {
      const int64_t width = std::min<int64_t>(32, n_dim - 32 * s);
      const __mmask32 cols = width == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << width) - 1);
      uint16_t* dst = out + s * pairs * 64;
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* r = w + 2 * p * n_dim + 32 * s;
        const __m512i a = _mm512_maskz_loadu_epi16(cols, r);
        const __m512i b = 2 * p + 1 < k_dim ? _mm512_maskz_loadu_epi16(cols, r + n_dim) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + p * 64, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(dst + p * 64 + 32, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
}

}  // namespace avx512

// Runs `work->run()` on the calling thread and on one helper per other pool thread (at most
// `tasks` in all), and returns once `work->done` counts `tasks`. A helper that starts after every
// task is claimed returns at once: it keeps the work alive, never touches the buffers, and nobody
// waits for it (two of these calls side by side on a pool of two never wait on each other's
// helpers).
template <typename W>
void run_on_pool(ffi::ThreadPool& pool, const std::shared_ptr<W>& work, int64_t tasks) {
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), tasks) - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  for (int spins = 0; work->done.load(std::memory_order_acquire) < tasks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// The blocks of weight rows, claimed one by one by the calling thread and its helpers. Each block
// sums into its own partial y and the caller adds the partials in block order, so y does not
// depend on which thread took which block.
struct Work {
  const uint16_t* x;
  const uint16_t* w;
  int64_t m, k, n, blocks;
  std::vector<float> partial;  // [blocks, M, N]
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < blocks;) {
      avx512::block(x, w, partial.data() + c * m * n, m, k, n, c * kBlock, std::min(k, (c + 1) * kBlock));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowsBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[0] < 1 || xd[0] > kMaxRows)
    return ffi::Error::InvalidArgument("rows_bf16: x [M, K] with 1 <= M <= 8 and w [K, N] expected");
  auto work = std::make_shared<Work>();
  work->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  work->w = reinterpret_cast<const uint16_t*>(w.typed_data());
  work->m = xd[0];
  work->k = xd[1];
  work->n = wd[1];
  work->blocks = (work->k + kBlock - 1) / kBlock;
  work->partial.assign(static_cast<size_t>(work->blocks * work->m * work->n), 0.0f);
  run_on_pool(pool, work, work->blocks);
  const int64_t size = work->m * work->n;
  float* out = y->typed_data();
  std::memcpy(out, work->partial.data(), sizeof(float) * size);
  for (int64_t c = 1; c < work->blocks; ++c) {
    const float* p = work->partial.data() + c * size;
    for (int64_t i = 0; i < size; ++i) out[i] += p[i];
  }
  avx512::unsplit(out, work->m, work->n);
  return ffi::Error::Success();
}

// The strips, claimed in runs by the calling thread and its helpers; each writes its own columns
// of y, every element summed over k in pairs in one order: the same bits whichever thread ran it.
// A claim takes a run of strips that follow each other in memory, a quarter of what is left per
// thread (at least one strip): the first runs are long streams the hardware prefetchers follow
// across strips, the last ones short so the threads finish together (one strip per claim streamed
// ~15 % slower). The caller returns only when every strip is done.
struct Strips {
  const uint16_t* x;
  const uint16_t* wp;
  float* y;
  int64_t m, k, pairs, strips, threads;
  std::atomic<int64_t> next{0}, done{0};

  bool claim(int64_t& c0, int64_t& c1) {
    int64_t cur = next.load(std::memory_order_relaxed);
    while (cur < strips) {
      const int64_t take = std::max<int64_t>(1, (strips - cur) / (2 * threads));
      if (next.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed)) {
        c0 = cur;
        c1 = cur + take;
        return true;
      }
    }
    return false;
  }

  void run() {
    for (int64_t c0, c1; claim(c0, c1);) {
      int64_t c = c0;
      if (m <= avx512::kSideBySideRows) {
        for (; c + 2 <= c1; c += 2) avx512::packed_strip_pair(x, m, k, wp, pairs, y, strips * 32, c);
      }
      for (; c < c1; ++c) avx512::packed_strip(x, m, k, wp, pairs, y, strips * 32, c);
      done.fetch_add(c1 - c0, std::memory_order_release);
    }
  }
};

constexpr int64_t kMaxPackedRows = 256;

ffi::Error PackedBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> wp,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != 64 || xd[0] < 1 || xd[0] > kMaxPackedRows || xd[1] < 1 ||
      (xd[1] + 1) / 2 != wd[1])
    return ffi::Error::InvalidArgument(
        "packed_bf16: x [M, K] with 1 <= M <= 256 and w packed [strips, ceil(K / 2), 64] expected");
  auto work = std::make_shared<Strips>();
  work->x = reinterpret_cast<const uint16_t*>(x.typed_data());
  work->wp = reinterpret_cast<const uint16_t*>(wp.typed_data());
  work->y = y->typed_data();
  work->m = xd[0];
  work->k = xd[1];
  work->pairs = wd[1];
  work->strips = wd[0];
  work->threads = std::max<int64_t>(1, pool.num_threads());
  run_on_pool(pool, work, work->strips);
  return ffi::Error::Success();
}

// `pack`: the weight laid out for `packed_bf16`, the strips split between the caller and one
// helper per other pool thread (halves of the strips in order; each writes its own).
struct Packing {
  const uint16_t* w;
  uint16_t* out;
  int64_t k, n, pairs, strips, parts;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < parts;) {
      const int64_t s0 = strips * c / parts, s1 = strips * (c + 1) / parts;
      avx512::pack_strips(w, k, n, out, pairs, s0, s1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PackBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> out) {
  const auto wd = w.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || od.size() != 3 || od[0] != (wd[1] + 31) / 32 || od[1] != (wd[0] + 1) / 2 || od[2] != 64)
    return ffi::Error::InvalidArgument("pack_bf16: w [K, N] and out [ceil(N / 32), ceil(K / 2), 64] expected");
  auto work = std::make_shared<Packing>();
  work->w = reinterpret_cast<const uint16_t*>(w.typed_data());
  work->out = reinterpret_cast<uint16_t*>(out->typed_data());
  work->k = wd[0];
  work->n = wd[1];
  work->pairs = od[1];
  work->strips = od[0];
  work->parts = std::min<int64_t>(work->strips, 16);
  run_on_pool(pool, work, work->parts);
  return ffi::Error::Success();
}

// --- delta_step: one decode token of the gated delta rule, per (row, value head) -------------
//
// For each row b and value head h, on float32 (q and k normalized and repeated to the value
// heads by the caller): decay = e^g, u = β (v − decay Sᵀk), o = decay Sᵀq + (kᵀq) u and
// S ← decay S + k uᵀ. Two passes over the head's state ([K, V], 64 KiB at 128 × 128): one read
// for Sᵀk and Sᵀq together, one read and write for the update, which finds the state in the
// core's cache; XLA:CPU made each pass a loop fusion of its own over every head (~28 µs each per
// layer of 8 heads on the 2-core machine). The heads are independent tasks and each is summed
// over k in one order (k ascending, 16 values of V per vector): the same bits whichever thread
// ran it.
namespace avx512 {

JAXPI_AVX512 void delta_head(float* s, const float* q, const float* k, const float* v, float g, float beta,
                             float* out, int64_t k_dim, int64_t v_dim) {
  const float decay = std::exp(g);
  float kq = 0.0f;
  for (int64_t i = 0; i < k_dim; ++i) kq += k[i] * q[i];
  for (int64_t j0 = 0; j0 < v_dim; j0 += 16) {  // 16 columns of the state at a time
    const int64_t width = std::min<int64_t>(16, v_dim - j0);
    const __mmask16 m = static_cast<__mmask16>((1u << width) - 1);
    __m512 sk = _mm512_setzero_ps(), sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < k_dim; ++i) {
      const __m512 row = _mm512_maskz_loadu_ps(m, s + i * v_dim + j0);
      sk = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), row, sk);
      sq = _mm512_fmadd_ps(_mm512_set1_ps(q[i]), row, sq);
    }
    const __m512 dec = _mm512_set1_ps(decay);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(beta),
                                   _mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + j0), _mm512_mul_ps(dec, sk)));
    _mm512_mask_storeu_ps(out + j0, m, _mm512_fmadd_ps(_mm512_set1_ps(kq), u, _mm512_mul_ps(dec, sq)));
    for (int64_t i = 0; i < k_dim; ++i) {
      float* r = s + i * v_dim + j0;
      const __m512 row = _mm512_maskz_loadu_ps(m, r);
      _mm512_mask_storeu_ps(r, m, _mm512_fmadd_ps(_mm512_set1_ps(k[i]), u, _mm512_mul_ps(dec, row)));
    }
  }
}

}  // namespace avx512

struct DeltaHeads {
  float* s;  // [B*H, K, V], updated in place
  const float *q, *k, *v, *g, *beta;
  float* out;
  int64_t heads, k_dim, v_dim;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t t; (t = next.fetch_add(1)) < heads;) {
      avx512::delta_head(s + t * k_dim * v_dim, q + t * k_dim, k + t * k_dim, v + t * v_dim, g[t], beta[t],
                         out + t * v_dim, k_dim, v_dim);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DeltaStep(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::F32> q,
                     ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g,
                     ffi::Buffer<ffi::F32> beta, ffi::ResultBuffer<ffi::F32> out,
                     ffi::ResultBuffer<ffi::F32> new_state) {
  const auto sd = state.dimensions(), qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto gd = g.dimensions(), bd = beta.dimensions();
  if (sd.size() != 4 || qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || gd.size() != 2 || bd.size() != 2 ||
      qd[0] != sd[0] || qd[1] != sd[1] || qd[2] != sd[2] || kd[0] != sd[0] || kd[1] != sd[1] || kd[2] != sd[2] ||
      vd[0] != sd[0] || vd[1] != sd[1] || vd[2] != sd[3] || gd[0] != sd[0] || gd[1] != sd[1] || bd[0] != sd[0] ||
      bd[1] != sd[1])
    return ffi::Error::InvalidArgument(
        "delta_step: state [B, H, K, V], q and k [B, H, K], v [B, H, V], g and beta [B, H] expected");
  auto work = std::make_shared<DeltaHeads>();
  work->s = new_state->typed_data();
  if (work->s != state.typed_data())  // XLA may not have aliased the two: update a copy
    std::memcpy(work->s, state.typed_data(), sizeof(float) * sd[0] * sd[1] * sd[2] * sd[3]);
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->g = g.typed_data();
  work->beta = beta.typed_data();
  work->out = out->typed_data();
  work->heads = sd[0] * sd[1];
  work->k_dim = sd[2];
  work->v_dim = sd[3];
  if (work->heads > 0) run_on_pool(pool, work, work->heads);
  return ffi::Error::Success();
}

// --- take_rows16: rows of a 2-byte table by index (the embedding lookup of a decode step) -------
//
// out[i, :] = table[ids[i], :], the bits copied. XLA:CPU gathers bf16 rows from a float32 copy of
// the whole table, and a gather of its uint16 bits (`jaxpi.models.qwen3_5.embed_rows`) still
// wrote a bitcast copy of the table once per call (a 64 MiB table: ~13 ms per call on the 2-core
// machine). As jnp.take: an index in [-V, 0) counts from the end, and one outside [-V, V) gives a
// row of 0xFFFF (a NaN).
ffi::Error TakeRows16(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions();
  if (td.size() != 2 || ffi::ByteWidth(table.element_type()) != 2 || out->element_type() != table.element_type())
    return ffi::Error::InvalidArgument("take_rows16: a [V, D] table of 2-byte elements expected");
  const int64_t v = td[0], d = td[1], n = ids.element_count();
  if (out->element_count() != n * d) return ffi::Error::InvalidArgument("take_rows16: out is not [ids, D]");
  const auto* src = static_cast<const uint16_t*>(table.untyped_data());
  auto* dst = static_cast<uint16_t*>(out->untyped_data());
  const int32_t* idx = ids.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    int64_t r = idx[i];
    if (r < 0) r += v;
    if (0 <= r && r < v) {
      std::memcpy(dst + i * d, src + r * d, sizeof(uint16_t) * d);
    } else {
      std::fill(dst + i * d, dst + (i + 1) * d, static_cast<uint16_t>(0xFFFF));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpiRowsBf16, RowsBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());


// Whether this CPU runs the kernel's instructions (AVX-512 F, BW, VL and FMA). Compiled for the
// baseline: safe to call on any x86-64.
extern "C" int jaxpi_rows_bf16_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpiPackedBf16, PackedBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpiPackBf16, PackBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

// Whether this CPU runs `packed_bf16` (also AVX-512 BF16). Compiled for the baseline.
extern "C" int jaxpi_packed_bf16_supported() {
  return jaxpi_rows_bf16_supported() && __builtin_cpu_supports("avx512bf16");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpiDeltaStep, DeltaStep,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpiTakeRows16, TakeRows16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

// take_rows16 is plain C++: any x86-64 runs it.
extern "C" int jaxpi_take_rows16_supported() { return 1; }
