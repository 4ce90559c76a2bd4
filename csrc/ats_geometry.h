// The geometry of one patch extraction, shared by the C++ entry points, the CUDA kernels
// and the host check of the wide kernel (check_wide.cpp); no ATen, so that check compiles alone.
#pragma once
#include <cstdint>

namespace ats {

// Sizes and strides in elements, all 64-bit: a 100k x 100k x 3 slide region overflows
// 32-bit indices (the 2019 reference kernel's bug).
struct Geometry {
  int64_t B, C, H, W, n, h, w;
  int64_t sB, sC, sH, sW;  // image strides
  bool channels_last;      // patches laid out [B, n, h, w, C] in memory instead of [B, n, C, h, w]
};

}  // namespace ats
