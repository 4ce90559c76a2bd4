// The forward gather of the CUDA kernel, 16 bytes per thread (issue 39). Written as a
// __host__ __device__ function of one output chunk so that the same code also runs on the
// host (csrc/check_wide.cpp compares it with the reference semantics on any machine).
//
// Why: one thread per output byte spent its time on index arithmetic (four 64-bit
// divisions per byte) and moved uint8 at 11% of the device's copy bandwidth. Here a thread
// owns 16 consecutive output bytes (16 / sizeof(T) elements, in the output's memory
// order), decodes where they come from once, and stores them with one 16-byte write (the
// output is freshly allocated, so every chunk is 16-byte aligned). The output is made of
// "rows": runs of L elements with one source row behind them, L = w for NCHW output (one
// channel of one patch row) and L = w * C for channels-last output (all channels of one
// patch row). When the chunk lies inside one row, inside the image, and that row is
// contiguous in the source, its 16 source bytes are read as four (or five) aligned 32-bit
// words and realigned with funnel shifts: the source rows of a patch start at any byte.
// Chunks across two rows, at the image border or from strided sources take the element
// path, whose index update is an increment per element, not a division.
#pragma once

#include <cstdint>
#include <cstring>

#include "ats_geometry.h"

namespace ats {

#if defined(__CUDACC__)
#define ATS_HD __host__ __device__ __forceinline__
#else
#define ATS_HD inline
#endif

// 16 bytes starting at any byte address p, read as aligned 32-bit words (never touching a
// word that holds none of the 16 bytes).
ATS_HD void load16(const unsigned char* p, uint32_t out[4]) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const unsigned shift = static_cast<unsigned>(a & 3u);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a - shift);
#if defined(__CUDA_ARCH__)
  if ((a & 15u) == 0) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    return;
  }
  uint32_t v[5];
  for (int k = 0; k < 4; ++k) v[k] = __ldg(w + k);
  v[4] = shift ? __ldg(w + 4) : 0u;
  for (int k = 0; k < 4; ++k) out[k] = __funnelshift_r(v[k], v[k + 1], 8u * shift);
#else
  uint32_t v[5];
  for (int k = 0; k < 4; ++k) std::memcpy(&v[k], w + k, 4);
  v[4] = 0u;
  if (shift) std::memcpy(&v[4], w + 4, 4);
  for (int k = 0; k < 4; ++k) {  // what __funnelshift_r computes (little-endian bytes)
    const uint64_t both = (static_cast<uint64_t>(v[k + 1]) << 32) | v[k];
    out[k] = static_cast<uint32_t>(both >> (8u * shift));
  }
#endif
}

// Output chunk `chunk` (elements [chunk * V, chunk * V + V) of the output's memory order,
// V = 16 / sizeof(T), fewer at the end) of the patches of `img` at `off`; L and
// `src_rows_contiguous` as described above.
template <typename T>
ATS_HD void extract_chunk(const T* __restrict__ img, const int64_t* __restrict__ off, T* __restrict__ out,
                          const Geometry& g, const int64_t total, const int64_t L, const bool src_rows_contiguous,
                          const int64_t chunk) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const int64_t i0 = chunk * V;
  const int n = static_cast<int>(total - i0 < V ? total - i0 : V);
  alignas(16) T buf[V];
  int64_t seg = i0 / L, r = i0 - seg * L;
  for (int done = 0; done < n;) {
    const int take = static_cast<int>(n - done < L - r ? n - done : L - r);
    int64_t p, c, y = seg % g.h;
    if (g.channels_last) {
      p = seg / g.h;
      c = 0;
    } else {
      const int64_t t = seg / g.h;
      c = t % g.C;
      p = t / g.C;
    }
    const int64_t row = off[2 * p] + y, col0 = off[2 * p + 1];
    const bool row_in = row >= 0 && row < g.H;
    const int64_t base = (p / g.n) * g.sB + row * g.sH;
    // columns of the first and last element of this piece
    const int64_t first = g.channels_last ? col0 + r / g.C : col0 + r;
    const int64_t last = g.channels_last ? col0 + (r + take - 1) / g.C : col0 + r + take - 1;
    if (take == V && src_rows_contiguous && row_in && first >= 0 && last < g.W) {
      // one source run: element r of the row is at col0 * sW + r past the row's start (NCHW: sW = 1;
      // channels-last: sW = C, sC = 1)
      load16(reinterpret_cast<const unsigned char*>(img + base + c * g.sC + col0 * g.sW + r),
             reinterpret_cast<uint32_t*>(buf));
    } else {
      int64_t x = g.channels_last ? r / g.C : r, ch = g.channels_last ? r % g.C : c;
      for (int j = 0; j < take; ++j) {
        const int64_t col = col0 + x;
        buf[done + j] = (row_in && col >= 0 && col < g.W) ? img[base + ch * g.sC + col * g.sW] : T(0);
        if (g.channels_last) {
          if (++ch == g.C) { ch = 0; ++x; }
        } else {
          ++x;
        }
      }
    }
    done += take;
    r = 0;
    ++seg;
  }
#if defined(__CUDA_ARCH__)
  if (n == V) {
    *reinterpret_cast<uint4*>(out + i0) = *reinterpret_cast<const uint4*>(buf);
    return;
  }
#endif
  for (int j = 0; j < n; ++j) out[i0 + j] = buf[j];
}

#undef ATS_HD

}  // namespace ats
