// CUDA kernels for patch extraction (issue 6). Forward: one thread per 16 OUTPUT BYTES
// in the output's memory order (ats_patches_wide.cuh, issue 39), with a grid-stride loop:
// neighbouring threads read neighbouring pixels of the same image row (NCHW) or the same
// pixel's channels (channels-last) and write neighbouring 16-byte chunks, so both sides
// are coalesced and wide. Backward: one thread per output element (atomic adds). 64-bit
// indices throughout; launched on the current stream of the tensors' own device.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "ats_patches.h"
#include "ats_patches_wide.cuh"

namespace {

// Output element i -> (patch p = b * n + k, channel c, row y, column x).
__device__ __forceinline__ void decode(int64_t i, const ats::Geometry& g, int64_t& p, int64_t& c, int64_t& y,
                                       int64_t& x) {
  if (g.channels_last) {
    c = i % g.C; i /= g.C;
    x = i % g.w; i /= g.w;
    y = i % g.h; p = i / g.h;
  } else {
    x = i % g.w; i /= g.w;
    y = i % g.h; i /= g.h;
    c = i % g.C; p = i / g.C;
  }
}

// Output element i -> index of its source pixel in the image, or -1 outside the image.
__device__ __forceinline__ int64_t source_of(int64_t i, const ats::Geometry& g, const int64_t* __restrict__ off) {
  int64_t p, c, y, x;
  decode(i, g, p, c, y, x);
  const int64_t row = off[2 * p] + y, col = off[2 * p + 1] + x;
  if (row < 0 || row >= g.H || col < 0 || col >= g.W) return -1;
  return (p / g.n) * g.sB + c * g.sC + row * g.sH + col * g.sW;
}

template <typename T>
__global__ void extract_kernel(const T* __restrict__ img, const int64_t* __restrict__ off, T* __restrict__ out,
                               const ats::Geometry g, const int64_t total, const int64_t L,
                               const bool src_rows_contiguous) {
  constexpr int64_t V = 16 / sizeof(T);
  const int64_t chunks = (total + V - 1) / V;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < chunks; k += stride) {
    ats::extract_chunk<T>(img, off, out, g, total, L, src_rows_contiguous, k);
  }
}

template <typename T>
__global__ void scatter_kernel(const T* __restrict__ grad, const int64_t* __restrict__ off, T* __restrict__ gimg,
                               const ats::Geometry g, const int64_t total) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t s = source_of(i, g, off);
    if (s >= 0) gpuAtomicAdd(gimg + s, grad[i]);  // patches may overlap: atomic, like the torch path's index_put_
  }
}

int blocks_for(int64_t total, int threads) {
  const int64_t wanted = (total + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
}

}  // namespace

namespace ats {

void extract_cuda(const at::Tensor& images, const at::Tensor& offsets, at::Tensor& out, const Geometry& g) {
  const c10::cuda::CUDAGuard guard(images.device());
  const int64_t total = out.numel();
  constexpr int threads = 256;
  auto stream = at::cuda::getCurrentCUDAStream();
  // a "row" of the output (ats_patches_wide.cuh) and whether its source is one contiguous run
  const int64_t L = g.channels_last ? g.w * g.C : g.w;
  const bool src_rows_contiguous = g.channels_last ? (g.sC == 1 && g.sW == g.C) : g.sW == 1;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 16 == 0, "patch output not 16-byte aligned");
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, images.scalar_type(), "ats_extract_cuda", [&] {
    constexpr int64_t V = 16 / sizeof(scalar_t);
    extract_kernel<scalar_t><<<blocks_for((total + V - 1) / V, threads), threads, 0, stream>>>(
        images.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), g,
        total, L, src_rows_contiguous);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_cuda(const at::Tensor& grad, const at::Tensor& offsets, at::Tensor& grad_images, const Geometry& g) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t total = grad.numel();
  constexpr int threads = 256;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "ats_scatter_cuda", [&] {
    scatter_kernel<scalar_t><<<blocks_for(total, threads), threads, 0, stream>>>(
        grad.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), grad_images.mutable_data_ptr<scalar_t>(),
        g, total);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ats
