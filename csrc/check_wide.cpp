// Host check of the CUDA forward gather's chunk logic (ats_patches_wide.cuh), which runs
// the very function the kernel runs, on the host: every chunk of random extractions is
// compared with the plain definition (zeros outside the image) for uint8, uint16, float
// and double, NCHW and channels-last output, contiguous, padded and strided sources,
// sources at odd byte addresses, patches across the border and wholly outside. Built and
// run by tests/test_native.py (no GPU needed). Exit status 0: all equal.
//   c++ -O2 -std=c++17 -I csrc csrc/check_wide.cpp -o check_wide && ./check_wide
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ats_patches_wide.cuh"

namespace {

std::mt19937_64 rng(39);

int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

template <typename T>
bool check_case(int index) {
  ats::Geometry g{};
  g.B = uniform(1, 3); g.C = uniform(1, 4); g.H = uniform(1, 70); g.W = uniform(1, 90);
  g.n = uniform(1, 5); g.h = uniform(1, 40); g.w = uniform(1, 60);
  const int layout = static_cast<int>(uniform(0, 3));  // 0 NCHW, 1 channels-last, 2 padded rows, 3 strided columns
  const int64_t pad = layout == 2 ? uniform(1, 9) : 0, step = layout == 3 ? 2 : 1;
  const bool cl_source = layout == 1 || (layout == 2 && uniform(0, 1));
  if (cl_source) {  // [B, H, W(+pad), C]
    g.sC = 1; g.sW = g.C; g.sH = (g.W + pad) * g.C; g.sB = g.H * g.sH;
  } else {  // [B, C, H, (W + pad) * step]
    g.sW = step; g.sH = (g.W + pad) * step; g.sC = g.H * g.sH; g.sB = g.C * g.sC;
  }
  g.channels_last = cl_source ? uniform(0, 3) > 0 : uniform(0, 5) == 0;  // any combination must work
  const int64_t lead = uniform(0, 17);  // the image at an odd address
  std::vector<T> storage(static_cast<size_t>(lead + g.B * g.sB + 64));
  for (auto& v : storage) v = static_cast<T>(uniform(1, 250));
  const T* img = storage.data() + lead;
  std::vector<int64_t> off(static_cast<size_t>(2 * g.B * g.n));
  for (int64_t p = 0; p < g.B * g.n; ++p) {
    off[2 * p] = uniform(-g.h - 2, g.H + 2);
    off[2 * p + 1] = uniform(-g.w - 2, g.W + 2);
  }
  const int64_t total = g.B * g.n * g.C * g.h * g.w;
  std::vector<T> want(static_cast<size_t>(total)), got(static_cast<size_t>(total) + 16, T(7));
  for (int64_t p = 0; p < g.B * g.n; ++p)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t y = 0; y < g.h; ++y)
        for (int64_t x = 0; x < g.w; ++x) {
          const int64_t row = off[2 * p] + y, col = off[2 * p + 1] + x;
          const int64_t o = g.channels_last ? (((p * g.h + y) * g.w + x) * g.C + c) : (((p * g.C + c) * g.h + y) * g.w + x);
          const bool in = row >= 0 && row < g.H && col >= 0 && col < g.W;
          want[o] = in ? img[(p / g.n) * g.sB + c * g.sC + row * g.sH + col * g.sW] : T(0);
        }
  const int64_t L = g.channels_last ? g.w * g.C : g.w;
  const bool contiguous_rows = g.channels_last ? (g.sC == 1 && g.sW == g.C) : g.sW == 1;
  constexpr int64_t V = 16 / sizeof(T);
  // the output at a 16-byte boundary, as the device allocator gives it
  T* out = got.data();
  while (reinterpret_cast<uintptr_t>(out) % 16) ++out;
  for (int64_t k = 0; k < (total + V - 1) / V; ++k) ats::extract_chunk<T>(img, off.data(), out, g, total, L, contiguous_rows, k);
  if (std::memcmp(out, want.data(), sizeof(T) * total) != 0) {
    std::printf("case %d (sizeof %zu, layout %d, channels_last %d): output differs\n", index, sizeof(T), layout,
                g.channels_last);
    return false;
  }
  return true;
}

}  // namespace

int main() {
  int bad = 0, cases = 0;
  for (int i = 0; i < 1500; ++i, cases += 4) {
    bad += !check_case<uint8_t>(i);
    bad += !check_case<uint16_t>(i);
    bad += !check_case<float>(i);
    bad += !check_case<double>(i);
  }
  std::printf("%d of %d cases differ\n", bad, cases);
  return bad ? 1 : 0;
}
