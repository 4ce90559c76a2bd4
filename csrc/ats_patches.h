// Shared between the C++ entry points and the CUDA kernels.
#pragma once
#include <ATen/ATen.h>

#include "ats_geometry.h"

namespace ats {

void extract_cuda(const at::Tensor& images, const at::Tensor& offsets, at::Tensor& out, const Geometry& g);
void scatter_cuda(const at::Tensor& grad, const at::Tensor& offsets, at::Tensor& grad_images, const Geometry& g);

}  // namespace ats
