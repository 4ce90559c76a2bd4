// Shared between the C++ entry points and the CUDA kernels.
#pragma once
#include <ATen/ATen.h>

namespace ats {

// Sizes and strides in elements, all 64-bit: a 100k x 100k x 3 slide region overflows
// 32-bit indices (the 2019 reference kernel's bug).
struct Geometry {
  int64_t B, C, H, W, n, h, w;
  int64_t sB, sC, sH, sW;  // image strides
  bool channels_last;      // patches laid out [B, n, h, w, C] in memory instead of [B, n, C, h, w]
};

void extract_cuda(const at::Tensor& images, const at::Tensor& offsets, at::Tensor& out, const Geometry& g);
void scatter_cuda(const at::Tensor& grad, const at::Tensor& offsets, at::Tensor& grad_images, const Geometry& g);

}  // namespace ats
